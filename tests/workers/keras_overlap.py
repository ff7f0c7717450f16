"""One rank of the Keras overlap job (4 ranks): a stale average is folded in exactly, and what overlap cannot
follow is refused.

Each rank's gradient is a constant of its own (``rank + 1``), applied in a traced step, so that a local step
moves every weight by ``-lr * (rank + 1)``. Every average, folded in a period late as ``model += average -
sent``, keeps the mean of the ranks' models; after ``synchronize_models`` every rank must hold the mean of what
each rank computed. With an average at every step (racks, then an exact bridge) every rank's weights are also
checked against the reference of overlapped averaging (``common.overlapped_reference``) once
``synchronize()`` has folded in the last one. A global average in fragments is checked the same ways.
Usage: keras_overlap.py
"""
import os

import common
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss
import numpy as np
import tensorflow as tf
from common import behaviour, check, expect_error, overlapped_reference
from hvd_dssync.fragments import FRAGMENTS_ENV
from hvd_dssync.plan import SyncPlan

hvd.init()
RANK, SIZE = common.identify(hvd)
LR = 0.125  # a power of two: float32 sums stay exact


def train(steps, **kwargs):
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(1, use_bias=False,
                                                                                   kernel_initializer="zeros")])
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(LR), overlap=True, model=model, **kwargs)
    model.compile(optimizer=opt, loss="mse")  # model.optimizer: what synchronize_models drains
    kernel = model.trainable_variables[0]
    gradient = tf.fill(kernel.shape, float(RANK + 1))

    @tf.function
    def step():
        opt.apply_gradients([(gradient, kernel)])

    for _ in range(steps):
        step()
    return model, opt, kernel


def weights(kernel):
    return hvd_tf.allgather_object(float(kernel.numpy().reshape(-1)[0]), name="test.weights")


def computed_mean(steps):
    """The mean of what the ranks computed in ``steps`` steps, which every average keeps."""
    return -LR * steps * sum(r + 1 for r in range(SIZE)) / SIZE


def check_stale_fold_is_exact(steps, **kwargs):
    model, _, kernel = train(steps, **kwargs)
    dss.synchronize_models(model)
    want = computed_mean(steps)
    got = kernel.numpy().reshape(-1)
    check(np.allclose(got, want, atol=1e-5),
          f"{kwargs}: after synchronize_models {got.tolist()}, want the mean of what the ranks computed {want}")


def check_against_the_reference(steps):
    """Racks then an exact bridge at every step: once the average in flight is folded in, every rank's weights
    are the reference's (a rank alone at a bridge folds its rack's average in when a poll finds it done, there
    or at the next average: the same weights once drained)."""
    options = common.BRIDGE_EVERY_STEP
    _, opt, kernel = train(steps, **options)
    _, drained = overlapped_reference(SyncPlan(rank=RANK, world_size=SIZE, **options), SIZE, steps, LR)
    opt.synchronize()
    got = weights(kernel)
    check(np.allclose(got, drained, atol=1e-5), f"after synchronize() {got}, want {drained}")


def check_global_average_folded_at_the_next_step():
    """A global average in flight is folded in at the step after it started (racks every 2 steps, every rank
    every 4: the global average of step 3), without waiting for the next average: after step 4 every rank
    holds that average plus its own local step."""
    options = dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=2, global_every=4,
                   schedule_options={"intra_steps": None})
    check(SyncPlan(rank=RANK, world_size=SIZE, **options).action(3).kind == "global", "no global average at step 3")
    model, _, kernel = train(5, **options)
    got = float(kernel.numpy().reshape(-1)[0]) + LR * (RANK + 1)
    check(abs(got - computed_mean(4)) < 1e-5, f"after step 4 the weight less its local step is {got}, want the global "
          f"average of step 3 {computed_mean(4)}")
    dss.synchronize_models(model)


def fragments_of(count, train_steps, **options):
    """``train`` with a global average in flight in ``count`` fragments (HVD_DSSYNC_GLOBAL_FRAGMENTS)."""
    os.environ[FRAGMENTS_ENV] = str(count)
    try:
        return train(train_steps, **options)
    finally:
        del os.environ[FRAGMENTS_ENV]


def check_fragments_fold_a_step_after_each_was_sent():
    """A global average in 3 fragments (racks every 4 steps, every rank every 8: the global average of step 7), the
    kernel's 3 rows one a fragment: row k is sent at step 7 + k and folded in at the next; after step 10 every rank
    holds in row k the global average of the models of step 7 + k plus its own local steps since."""
    options = dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=4, global_every=8,
                   schedule_options={"intra_steps": None})
    check(SyncPlan(rank=RANK, world_size=SIZE, **options).action(7).kind == "global", "no global average at step 7")
    model, _, kernel = fragments_of(3, 11, **options)
    got = kernel.numpy().reshape(-1) + LR * (RANK + 1) * np.array([3, 2, 1])
    want = [computed_mean(8 + k) for k in range(3)]
    check(np.allclose(got, want, atol=1e-5), f"after step 10 the rows less their local steps since their fragment "
          f"was sent are {got.tolist()}, want the global averages of steps 7, 8 and 9 {want}")
    dss.synchronize_models(model)


def check_refusals():
    sgd = tf.keras.optimizers.SGD(0.1)
    expect_error(ValueError, ["compression", "overlap=True"], lambda: dss.DistributedOptimizer(
        sgd, overlap=True, compression=hvd.Compression.fp16, num_groups=1))
    expect_error(ValueError, ["adaptive policy", "overlap=True"], lambda: dss.DistributedOptimizer(
        sgd, overlap=True, policy="adaptive"))
    os.environ[FRAGMENTS_ENV] = "two"  # a global average's fragments: a whole number
    try:
        expect_error(ValueError, [f"{FRAGMENTS_ENV}='two'", "whole number"], lambda: dss.DistributedOptimizer(
            sgd, overlap=True, num_groups=1))
    finally:
        del os.environ[FRAGMENTS_ENV]


for name, steps, options in common.STALE_FOLD_CASES:
    with behaviour(name):
        check_stale_fold_is_exact(steps, **options)
with behaviour("overlapped racks and bridges match the reference once drained"):
    check_against_the_reference(10)
with behaviour("a global average in flight is folded in at the next step"):
    check_global_average_folded_at_the_next_step()
with behaviour("a global average in fragments: each folded in a step after it was sent"):
    check_fragments_fold_a_step_after_each_was_sent()
for options in (dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=2, global_every=8),
                dict(schedule="shuffle", num_groups=2, average_every=3, global_every=6)):
    with behaviour(f"a global average in fragments is folded in exactly ({options['schedule']}, exact bridges too)"):
        model, _, kernel = fragments_of(3, 29, **options)
        dss.synchronize_models(model)
        check(np.allclose(kernel.numpy(), computed_mean(29), atol=1e-5),
              f"{options}: after synchronize_models {kernel.numpy().reshape(-1).tolist()}, want {computed_mean(29)}")
with behaviour("what overlap cannot follow is refused"):
    check_refusals()
with behaviour("SynchronizeModelsCallback folds in the average in flight before an evaluation, on that rank alone"):
    steps = 6
    model, opt, kernel = train(steps, schedule="shuffle", num_groups=1, average_every=1)
    want = computed_mean(steps)
    flight = opt._dssync.averaging.overlapped.flight
    check(flight.pending and not np.allclose(kernel.numpy(), want, atol=1e-5),
          f"before evaluating: pending {flight.pending}, weights {kernel.numpy().reshape(-1).tolist()}")
    if RANK == 0:
        callback = dss.callbacks.SynchronizeModelsCallback()
        callback.set_model(model)
        callback.on_test_begin()
        check(not flight.pending and np.allclose(kernel.numpy(), want, atol=1e-5),
              f"after on_test_begin: pending {flight.pending}, weights {kernel.numpy().reshape(-1).tolist()}, "
              f"want the mean {want}")
    dss.synchronize_models(model)
    check(np.allclose(kernel.numpy(), want, atol=1e-5), f"after synchronize_models {kernel.numpy().tolist()}")
with behaviour("the script ends with an average in flight: the exit drain folds it in"):
    _, opt, _ = train(5, schedule="shuffle", num_groups=2, average_every=1)
    check(opt._dssync.averaging.overlapped.flight.pending, "the last step's average is not in flight")
print(f"rank {RANK}: all checks passed", flush=True)
