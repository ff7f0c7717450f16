"""One rank of the Keras fidelity job: scripts written for Horovod's Keras optimizer keep working.

Scenarios, in one job: Horovod's resume recipe (rank 0 alone loads a model at step 5, the broadcast comes
after the first batch), for the Keras optimizers, the legacy ones and ``ModelAverager``; mixed precision
with one rank's gradients overflowing, in both orders of wrapping; a rank a step behind its group stops
all members with an error naming the steps; Horovod's optimizer attributes.

Every check raises on failure, so a failing rank exits non-zero and fails the launch.
"""
import os
import tempfile

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf
from common import check, check_alike, expected_values, fail
from keras_semantics import progress, RANK, SIZE, CheckEachStep, rank_valued_model

OPTIONS = {"num_groups": 2, "seed": 4}  # groups of step 5 differ from those of step 0 (checked below)
SAVED_STEPS = 5


def same_everywhere(value, what):
    everyone = hvd_tf.allgather_object(value, name=f"test.{what}")
    check_alike(everyone, f"{what} differs between ranks: {everyone}")


def data(steps, overflow_at=None):
    x = np.random.default_rng(RANK).normal(size=(4 * steps, 3)).astype(np.float32)
    if overflow_at is not None and RANK == SIZE - 1:
        x[4 * overflow_at:4 * overflow_at + 4] = 1e5  # beyond float16: this rank's gradients are not finite
    return x, np.zeros((4 * steps, 2), np.float32)


class IterationsAfterFirstBatch(tf.keras.callbacks.Callback):
    """Placed before Horovod's broadcast callback: sees each rank's own ``iterations`` after batch 0."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.first = int(self.model.optimizer.iterations.numpy())


def named_model():
    """Horovod's broadcast matches variables by name: the model every process builds has the same names."""
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2, name="dense"),
                                 tf.keras.layers.BatchNormalization(name="statistics")])
    for v in model.variables:
        v.assign(tf.fill(v.shape, float(RANK)))
    return model


def check_resume_recipe(base, directory, what):
    """Horovod's recipe: rank 0 loads the saved model; the others build a fresh one; broadcast after batch 0."""
    progress('check_resume_recipe')
    path = os.path.join(directory, f"{what}.h5")
    trained = named_model()
    trained.compile(optimizer=dss.DistributedOptimizer(base.from_config(base.get_config()), model=trained, **OPTIONS),
                    loss="mse")
    x, y = data(SAVED_STEPS)
    trained.fit(x, y, batch_size=4, verbose=0)
    if RANK == 0:
        trained.save(path)
        model = dss.load_model(path, **OPTIONS)
    else:
        model = named_model()
        model.compile(optimizer=dss.DistributedOptimizer(base.from_config(base.get_config()), model=model, **OPTIONS),
                      loss="mse")
    opt = model.optimizer
    plan = opt._dssync.plan
    if SIZE >= 3:
        check(plan.schedule.groups(0) != plan.schedule.groups(SAVED_STEPS), "the test needs other groups at step 5")
    first = IterationsAfterFirstBatch()
    x, y = data(4)
    # Horovod's BroadcastGlobalVariablesCallback(0) is left out: after a load, its by-name broadcast of the
    # variables hangs in this job (open); what DS-Sync adds, the first step's adoption, is checked.
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False, callbacks=[first])
    check(first.first == SAVED_STEPS + 1, f"{what}: after the first batch iterations is {first.first}, want rank 0's "
          f"{SAVED_STEPS} + 1")
    check(opt.sync_step == SAVED_STEPS + 4, f"{what}: sync_step {opt.sync_step}, want {SAVED_STEPS + 4}")
    same_everywhere(opt.sync_step, f"{what}.sync_step")


def check_resume_custom_loop(directory):
    """ModelAverager: rank 0 restores a checkpoint at step 5; the others start at 0; the first call agrees."""
    progress('check_resume_custom_loop')
    averager = dss.ModelAverager(**OPTIONS, name="ResumeAverager")
    variables = [tf.Variable(tf.fill([3], float(RANK)))]
    prefix = os.path.join(directory, "averager")
    if RANK == 0:
        averager.step.assign(SAVED_STEPS)
        path = tf.train.Checkpoint(averager=averager).write(prefix)
        averager.step.assign(0)
        tf.train.Checkpoint(averager=averager).read(path).assert_consumed()
    step = tf.function(lambda: averager(variables))
    step()
    check(int(averager.step.numpy()) == SAVED_STEPS + 1, f"averager at step {averager.step.numpy()} after one call")
    same_everywhere(int(averager.step.numpy()), "averager.step")


def check_mixed_precision(order, legacy=False, steps=5, overflow_at=2):
    """One rank overflows at one step: every rank skips it (no update, no average) and the loss scales agree."""
    progress('check_mixed_precision')
    what = f"mixed precision, {order}{', legacy' if legacy else ''}"
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2)])
        for v in model.variables:
            v.assign(tf.fill(v.shape, float(RANK)))
        sgd = (tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD)(0.0)
        if order == "LossScaleOptimizer(dss)":
            opt = dss.DistributedOptimizer(sgd, **OPTIONS)
            model.compile(optimizer=opt, loss="mse")  # compile wraps it under the mixed_float16 policy
            check(model.optimizer.inner_optimizer is opt, f"{what}: compile did not wrap the optimizer")
        else:
            opt = dss.DistributedOptimizer(tf.keras.mixed_precision.LossScaleOptimizer(sgd), **OPTIONS)
            model.compile(optimizer=opt, loss="mse")
            check(model.optimizer is opt, f"{what}: compile wrapped the loss-scale optimizer again")
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    history = expected_values(opt._dssync.plan, SIZE, steps, skipped=(overflow_at,))
    x, y = data(steps, overflow_at)
    # Keras starts at 2**15, which overflows float16 here on every rank; start low, so only the chosen step does.
    model.optimizer._loss_scale.current_loss_scale.assign(4.0)
    scale = float(model.optimizer.loss_scale.numpy())
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False, callbacks=[CheckEachStep(history, what)])
    check(int(model.optimizer.iterations.numpy()) == steps, f"{what}: iterations {model.optimizer.iterations.numpy()}")
    check(float(model.optimizer.loss_scale.numpy()) == scale / 2, f"{what}: loss scale {scale} -> "
          f"{model.optimizer.loss_scale.numpy()}, want halved once (one skipped step on every rank)")
    same_everywhere([int(model.optimizer.iterations.numpy()), float(model.optimizer.loss_scale.numpy())],
                    f"{what}.iterations")


def check_drift_detected(what, **options):
    """A rank one step ahead of its group: every member stops at the average, with the steps in the message."""
    progress('check_drift_detected')
    model = rank_valued_model()
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), num_groups=1, **options)
    model.compile(optimizer=opt, loss="mse")
    x, y = data(2)
    model.fit(x[:4], y[:4], batch_size=4, verbose=0)
    if RANK == SIZE - 1:
        opt.iterations.assign_add(1)
    try:
        model.fit(x[4:], y[4:], batch_size=4, verbose=0)
    except tf.errors.InvalidArgumentError as e:
        message = str(e)
        check("ranks are at different DS-Sync steps" in message and f"rank {RANK} is at step" in message,
              f"{what}: the error does not say why: {message[:2000]}")
        want = "2" if RANK == SIZE - 1 else "1"
        check(f"is at step] [{want}]" in message,
              f"{what}: the error does not name this rank's step {want}: {message[:2000]}")
        reason = next(line for line in message.splitlines() if "ranks are at different DS-Sync steps" in line)
        print(f"rank {RANK}: {what}: stopped: {reason.strip()[:300]}", flush=True)
    else:
        fail(f"{what}: ranks at different steps averaged silently")


def check_horovod_attributes():
    """The attributes of Horovod's Keras optimizers that scripts and Horovod's own tests read."""
    progress('check_horovod_attributes')
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2)])
    for legacy in (False, True):
        sgd = (tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD)(0.1)
        opt = dss.DistributedOptimizer(sgd, num_groups=1, scale_local_gradients=False)
        check(opt._agg_helper is None and opt.process_set is hvd.global_process_set
              and opt.scale_local_gradients is False, "Horovod's plain attributes")
        x = tf.constant(np.random.default_rng(RANK).normal(size=(4, 3)), tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        plain = tape.gradient(loss, model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        mine = opt._compute_gradients(loss, model.trainable_variables, tape=tape)
        check(all(np.array_equal(g.numpy(), p.numpy()) for (g, _), p in zip(mine, plain)),
              "_compute_gradients is not this rank's own gradient")
        averaged = opt._allreduce_grads([tf.constant(float(RANK)), None], None)
        check(float(averaged[0]) == (SIZE - 1) / 2 and averaged[1] is None, f"_allreduce_grads gave {averaged}")
        opt.register_local_var(model.trainable_variables[1])
        check(model.trainable_variables[1].ref() in opt._local_vars, "_local_vars misses a registered variable")
        check(isinstance(opt.variables(), list), "variables() is not callable, as Horovod's callbacks call it")
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), num_groups=1, backward_passes_per_step=3,
                                   average_aggregated_gradients=True)
    helper = opt._agg_helper
    check(helper.backward_passes_per_step == 3 and helper.average_aggregated_gradients, "_agg_helper's arguments")
    opt.iterations.assign(4)
    check(int(helper.counter) == 1, f"_agg_helper.counter {helper.counter}")


def main():
    check_mixed_precision("LossScaleOptimizer(dss)")
    check_mixed_precision("LossScaleOptimizer(dss)", legacy=True)
    check_mixed_precision("dss(LossScaleOptimizer)")
    check_drift_detected("drift")
    check_drift_detected("drift in warm-up", warmup_steps=10)
    check_horovod_attributes()
    with tempfile.TemporaryDirectory(prefix=f"dssync-fidelity-rank{RANK}-") as directory:
        # Without slots: a loaded optimizer names its slots unlike a fresh one, and Horovod's broadcast
        # matches by name (as with Horovod's own optimizer).
        check_resume_recipe(tf.keras.optimizers.SGD(0.01), directory, "resume")
        check_resume_recipe(tf.keras.optimizers.legacy.SGD(0.01), directory, "resume, legacy")
        check_resume_custom_loop(directory)
    hvd.allreduce(tf.constant(1.0), name="test.done")
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
