"""One rank of the Keras semantics job: group means inside one traced ``fit``, policies, callbacks,
the custom-loop averager, Horovod's own callbacks, and the drop-in contract.

Every check raises on failure, so a failing rank exits non-zero and fails the launch.
"""
import argparse

import common
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf
from common import behaviour, check, check_alike, check_idle_loop, expect_error, expected_values, fail
from hvd_dssync import SyncConfig, horovod_loop
from hvd_dssync.schedules import Shuffle

hvd.init()
RANK, SIZE = common.identify(hvd)


def progress(what):
    print(f"rank {RANK}: {what}", flush=True)


def user_unnamed_ops():
    """What a user script does between steps; hangs if DS-Sync's op sequence differed between ranks."""
    total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
    check(float(total[0]) == SIZE, f"unnamed allreduce gave {total}")


def rank_valued_model():
    # momentum=1.0 keeps the BatchNorm statistics where we put them, though it runs in training mode.
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2),
                                 tf.keras.layers.BatchNormalization(momentum=1.0)])
    for v in model.variables:
        v.assign(tf.fill(v.shape, float(RANK)))
    return model


class CheckEachStep(tf.keras.callbacks.Callback):
    def __init__(self, history, what, non_trainable=True):
        super().__init__()
        self.history, self.what, self.non_trainable, self.step = history, what, non_trainable, 0

    def on_train_batch_end(self, batch, logs=None):
        want = self.history[self.step][RANK]
        for v in self.model.variables:
            if not v.trainable and not self.non_trainable:
                check(np.all(v.numpy() == RANK), f"{self.what}: local {v.name} was averaged: {v.numpy()}")
                continue
            got = v.numpy().reshape(-1)
            check(np.allclose(got, want, atol=1e-5),
                  f"{self.what} step {self.step}: {v.name} holds {got.tolist()}, want the group mean {want}")
        self.step += 1


def check_group_means_in_fit(what, steps=8, non_trainable=True, give_model=True, **kwargs):
    model = rank_valued_model()
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), seed=7, average_non_trainable=non_trainable,
                                   model=model if give_model else None, **kwargs)
    model.compile(optimizer=opt, loss="mse")
    history = expected_values(opt._dssync.plan, SIZE, steps)
    x = np.random.default_rng(RANK).normal(size=(4 * steps, 3)).astype(np.float32)
    y = np.zeros((4 * steps, 2), np.float32)
    checker = CheckEachStep(history, what, non_trainable and give_model)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[checker])
    check(checker.step == steps, f"{what}: {checker.step} steps checked, want {steps}")
    check(not model.run_eagerly, "fit ran eagerly")
    # Keras traces twice on the first call (the second after creating the optimizer's variables).
    traces = model.train_function.experimental_get_tracing_count()
    check(traces <= 2, f"{what}: train_function traced {traces} times in {steps} steps")
    check(opt.sync_step == steps, f"{what}: sync_step {opt.sync_step} != {steps}")
    if not give_model:  # the traced step keeps what it found: a model given now is refused, not dropped
        expect_error(RuntimeError, ["set_model after the step was traced"], lambda: opt.set_model(model))
    distinct = {tuple(history[t]) for t in range(steps)}
    return opt, distinct


def check_custom_loop():
    """ModelAverager inside one tf.function: the group changes from call to call."""
    averager = dss.ModelAverager(num_groups=SIZE, global_every=2, seed=3, name="TestAverager")
    variables = [tf.Variable(tf.fill([3], float(RANK))), tf.Variable(float(RANK))]
    history = expected_values(averager._sync.plan, SIZE, 4)

    @tf.function
    def step():
        averager(variables)

    for t in range(4):
        step()
        for v in variables:
            check(np.allclose(v.numpy(), history[t][RANK]), f"averager step {t}: {v.numpy()} != {history[t][RANK]}")
    check(step.experimental_get_tracing_count() == 1, "the averager's step was traced more than once")
    check(int(averager.step.numpy()) == 4, f"averager step counter {averager.step.numpy()}")
    grads = averager.gradients([tf.constant(float(RANK))])
    check(float(grads[0]) == RANK, "gradients changed outside the warm-up")
    warm = dss.ModelAverager(num_groups=SIZE, warmup_steps=1, name="TestWarmup")
    grads = tf.function(warm.gradients)([tf.constant(float(RANK)), None])
    check(abs(float(grads[0]) - (SIZE - 1) / 2) < 1e-6 and grads[1] is None, f"warm-up gradients {grads}")


def check_training_with_callbacks():
    """Real training with Horovod's callbacks and ours: consensus at the end, the distance in the logs."""
    rng = np.random.default_rng(RANK)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (x.sum(axis=1, keepdims=True) > 0).astype(np.float32)
    tf.keras.utils.set_random_seed(RANK)  # different initial weights: the broadcast must fix them
    model = tf.keras.Sequential([tf.keras.Input(shape=(5,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(1)])
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), num_groups=min(2, SIZE),
                                   seed=1, model=model)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=1, steps_per_epoch=8,
                                                          momentum_correction=False),
                 dss.callbacks.ConsensusDistanceCallback(), dss.callbacks.SyncStatsCallback(),
                 dss.callbacks.SynchronizeModelsCallback()]
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    floats = [v for v in model.variables if v.dtype.is_floating]
    model_bytes = sum(v.shape.num_elements() * 4 for v in floats)
    want = [sum(int(2 * (len(g) - 1) * model_bytes // len(g)) for g in
                (opt.schedule.group_of(RANK, t) for t in range(8 * epoch, 8 * (epoch + 1))))
            for epoch in range(2)]
    check(history.history["dssync_bytes_sent"] == want,
          f"bytes sent per epoch {history.history['dssync_bytes_sent']}, want {want}")
    seconds = history.history["dssync_sync_seconds"]
    communicates = [w > 0 for w in want]
    check([s > 0 for s in seconds] == communicates and all(s < 60 for s in seconds),
          f"sync seconds per epoch {seconds}: want > 0 exactly in epochs that send bytes {want}")
    distances = history.history["consensus_distance"]
    everyone = hvd_tf.allgather_object(distances, name="test.distances")
    check_alike(everyone, f"consensus distances differ between ranks: {everyone}")
    if SIZE > 1:
        check(distances[-1] > 0, f"models trained on different data should differ: {distances}")
    flat = np.concatenate([v.numpy().reshape(-1) for v in model.variables])
    rows = hvd_tf.allgather_object(flat, name="test.weights")
    common.check_consensus(rows, np.array_equal, dss.consensus_distance(model, non_trainable=True),
                           "SynchronizeModelsCallback")
    maes = hvd_tf.allgather_object(history.history["mae"], name="test.mae")
    check_alike(maes, f"MetricAverageCallback left different metrics: {maes}")


def check_backward_passes(base, what):
    """backward_passes_per_step=2: the first pass only counts; the second applies the sum of both passes'
    gradients, then the step's group (here all ranks) averages."""
    tf.keras.utils.set_random_seed(5)  # the same initial weights on every rank
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2)])
    start = [v.numpy() for v in model.trainable_variables]
    opt = dss.DistributedOptimizer(base, num_groups=1, backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(100 + RANK)
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)
    passes = []
    for b in (slice(0, 4), slice(4, 8)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[b]) - y[b]))
        passes.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    mine = [w - 0.1 * (g1 + g2) for w, g1, g2 in zip(start, *passes)]
    everyone = hvd_tf.allgather_object(mine, name=f"test.passes.{what}")
    want = [np.mean([e[i] for e in everyone], axis=0) for i in range(len(start))]
    model.train_on_batch(x[:4], y[:4])
    check(int(opt.iterations.numpy()) == 1 and opt.sync_step == 0,
          f"{what}: after one pass iterations {opt.iterations.numpy()}, sync_step {opt.sync_step}")
    check(all(np.array_equal(v.numpy(), w) for v, w in zip(model.trainable_variables, start)),
          f"{what}: the first of two passes changed the weights")
    model.train_on_batch(x[4:], y[4:])
    check(int(opt.iterations.numpy()) == 2 and opt.sync_step == 1,
          f"{what}: after two passes iterations {opt.iterations.numpy()}, sync_step {opt.sync_step}")
    got = [v.numpy() for v in model.trainable_variables]
    check(all(np.allclose(g, w, atol=1e-6) for g, w in zip(got, want)),
          f"{what}: after two passes the weights are {got}, want the mean over ranks of one step on the sum "
          f"of both passes' gradients {want}")


def check_drop_in():
    base = tf.keras.optimizers.SGD(tf.keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5), momentum=0.9)
    # Horovod's arguments by position, in Horovod's order (num_groups, Horovod's 11th, is DS-Sync's).
    opt, warned = common.horovod_argument_warnings(lambda: dss.DistributedOptimizer(
        base, "DropIn", "", "", hvd.Compression.none, False, 1.0, hvd.Average, 1, False, 1, None,
        hvd.global_process_set, True, seed=3))
    check(len(warned) == 1, f"Horovod's num_groups gave {len(warned)} HorovodArgumentWarning(s)")
    check(isinstance(opt, tf.keras.optimizers.SGD), "the optimizer is no longer an SGD")
    check(type(opt).__name__ == "SGD", f"class name {type(opt).__name__}")
    check(opt.get_config() == base.get_config(), "get_config differs from the wrapped optimizer's")
    legacy, warned = common.horovod_argument_warnings(lambda: dss.DistributedOptimizer(
        tf.keras.optimizers.legacy.Adam(0.01), sync=SyncConfig(num_groups=min(2, SIZE))))
    check(not warned, f"DS-Sync's num_groups through sync= warned {[str(w.message) for w in warned]}")
    check(isinstance(legacy, tf.keras.optimizers.legacy.Adam), "the legacy optimizer lost its class")
    for kwargs, error in [({"op": hvd_tf.Adasum}, "Adasum"), ({"backward_passes_per_step": 0}, "positive"),
                          ({"num_groups": SIZE + 1}, "num_groups"), ({"group_size": 2, "num_groups": 1}, "exactly one"),
                          ({"schedule_options": {"window_steps": 10}}, "window_steps"),
                          ({"warmup_steps": -1}, "warmup_steps")]:
        try:
            dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **{"num_groups": 1, **kwargs})
        except ValueError as e:
            check(error in str(e), f"{kwargs}: message {e} does not name {error}")
        else:
            fail(f"{kwargs} was accepted")
    if SIZE > 1:
        try:
            dss.ModelAverager(num_groups=min(2, SIZE), seed=RANK, name="TestMismatch")
        except ValueError as e:
            check("disagree on seed (rank 0 has 0, rank 1 has 1" in str(e), f"mismatched seeds gave {e}")
        else:
            fail("ranks with different seeds were accepted")
    if SIZE > 1:  # rank 0 averages the model's statistics, the others do not: an error, never a hang
        model = rank_valued_model()
        model.compile(optimizer=dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), num_groups=1,
                                                         model=model if RANK == 0 else None), loss="mse")
        try:
            model.fit(np.zeros((4, 3), np.float32), np.zeros((4, 2), np.float32), batch_size=4, verbose=0)
        except ValueError as e:
            check("disagree on parameters (rank 0 has 6 tensors" in str(e) and "rank 1 has 4 tensors" in str(e),
                  f"ranks averaging different variables gave {e}")
        else:
            fail("ranks averaging different variables trained")
    try:
        dss.DistributedOptimizer(object(), num_groups=1)
    except TypeError:
        pass
    else:
        fail("a non-optimizer was accepted")


def check_shuffle_in_fit(num_groups):
    """Group means in fit with the default shuffle, and its groups: they change, and equal the PyTorch adapter's."""
    opt, _ = check_group_means_in_fit("shuffle", num_groups=num_groups)
    schedules = [opt.schedule.groups(t) for t in range(8)]
    if SIZE >= 3:
        check(len(set(schedules)) > 1, f"the shuffle never changed its groups: {schedules}")
    # The same seed gives the PyTorch adapter's groups: both build the core's Shuffle.
    torch_default = Shuffle(SIZE, num_groups=num_groups, seed=7)
    check(all(opt.schedule.groups(t) == torch_default.groups(t) for t in range(200)),
          "the Keras adapter's groups differ from the PyTorch adapter's")


def check_global_every_in_fit():
    """Singleton groups, then the global average every third step: the values change even on 2 ranks."""
    _, distinct = check_group_means_in_fit("global_every", num_groups=SIZE, global_every=3)
    if SIZE > 1:
        check(len(distinct) > 1, "global_every=3 never changed the values")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    num_groups = 2 if SIZE > 1 else 1
    racks = [list(range((SIZE + 1) // 2)), list(range((SIZE + 1) // 2, SIZE))]
    checks = [
        ("group means in fit, shuffle", lambda: check_shuffle_in_fit(num_groups)),
        ("a script's unnamed ops after DS-Sync's", user_unnamed_ops),
        ("group means in fit, global_every", check_global_every_in_fit),
        ("group means in fit, warm-up", lambda: check_group_means_in_fit("warm-up", num_groups=num_groups,
                                                                         warmup_steps=2, global_every=2)),
        ("group means in fit, butterfly", lambda: check_group_means_in_fit("butterfly", schedule="butterfly")),
        ("group means in fit, local steps", lambda: check_group_means_in_fit(
            "local steps", steps=12, num_groups=num_groups, average_every=2, global_every=6)),
        ("group means in fit, topology", lambda: check_group_means_in_fit(
            "topology", schedule="topology", topology=racks, schedule_options={"intra_steps": 1})),
        ("group means in fit, local statistics", lambda: check_group_means_in_fit(
            "local statistics", num_groups=1, non_trainable=False)),
        # model.fit hands the optimizer only the trainable variables: without model=, Horovod's behaviour.
        ("group means in fit, no model", lambda: check_group_means_in_fit(
            "no model: local statistics", num_groups=1, give_model=False)),
    ]
    if not args.quick:
        checks += [
            ("custom training loop", check_custom_loop),
            ("training with callbacks", check_training_with_callbacks),
            ("drop-in arguments", check_drop_in),
            ("backward_passes_per_step", lambda: check_backward_passes(tf.keras.optimizers.SGD(0.1), "passes")),
            ("backward_passes_per_step, legacy optimizer", lambda: check_backward_passes(
                tf.keras.optimizers.legacy.SGD(0.1), "passes, legacy optimizer")),
        ]
    checks.append(("Horovod's loop idle between averages", lambda: check_idle_loop(horovod_loop)))
    checks.append(("a script's unnamed ops, again", user_unnamed_ops))
    for name, run_checks in checks:
        with behaviour(name):
            run_checks()
    print(f"rank {RANK}: all checks passed", flush=True)

if __name__ == "__main__":
    main()
