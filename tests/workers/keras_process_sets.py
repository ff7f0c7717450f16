"""One rank of a 4-rank Keras job: DS-Sync inside Horovod process sets, and lossy (fp16) compression.

As ``torch_process_sets.py``, with the group chosen in one traced step: process set A = {1, 2, 3} trains
in groups of 2 while rank 0 trains alone in B = {0}; sets {0, 2} and {1, 3} train side by side with a
warm-up and global averages; bad process sets are refused; fp16 compression keeps updates far below its
resolution, within its error bound of the exact group means. DS-Sync's arguments are one
``hvd_dssync.SyncConfig`` passed as ``sync=`` (registering the groups and building the optimizers), but
where a refusal of the keywords is checked and in the fp16 part. Every check raises on failure.
"""
from dataclasses import replace

import common
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf
from common import check, expect_error, simulate
from hvd_dssync import SyncConfig

SCHEDULE = dict(group_size=2, seed=7)
SYNC = SyncConfig(**SCHEDULE)
RANK = None


def model_at(value, width=3):
    model = tf.keras.Sequential([tf.keras.Input((width,)), tf.keras.layers.Dense(1, name="dense")], name="model")
    for v in model.trainable_variables:
        v.assign(tf.fill(v.shape, value))
    return model


def stepper(model, opt, gradient):
    @tf.function
    def step():
        grads = [tf.fill(v.shape, gradient) for v in model.trainable_variables]
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step


def arguments(**kwargs):
    """DS-Sync's arguments as ``sync=``: one SyncConfig (keywords where the topology's refusal is checked)."""
    return dict(SCHEDULE, **kwargs) if "topology" in kwargs else {"sync": replace(SYNC, **kwargs)}


def train_inside(process_set, steps, lr, **kwargs):
    ranks = sorted(process_set.ranks)
    model = model_at(float(RANK))
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(lr), process_set=process_set, model=model,
                                   **arguments(**kwargs))
    start = {r: float(r) for r in ranks}  # rank r starts at r, with gradient r
    history = simulate(ranks, opt.schedule, opt.policy, start, start, lr, steps)
    step = stepper(model, opt, float(RANK))
    for t in range(steps):
        step()
        for v in model.trainable_variables:
            check(np.allclose(v.numpy(), history[t][RANK], atol=1e-5),
                  f"set {ranks} step {t}: {v.numpy().ravel().tolist()}, want {history[t][RANK]}")
    return model


def check_process_sets(sets):
    a, b, c, d = sets
    mine = a if a.included() else b
    model = train_inside(mine, steps=6, lr=0.0)
    mean = sum(mine.ranks) / len(mine.ranks)
    dss.synchronize_models(model, process_set=mine)
    check(all(np.allclose(v.numpy(), mean, atol=1e-5) for v in model.trainable_variables), "synchronize_models")
    check(dss.consensus_distance(model, process_set=mine) < 1e-6, "not in consensus after synchronize_models")
    train_inside(c if c.included() else d, steps=5, lr=0.1, warmup_steps=1, global_every=2)
    expect_error(ValueError, ["process_set", "not registered"], lambda: train_inside(hvd.ProcessSet([0, 1]), 1, 0.0))
    expect_error(ValueError, ["process_set", "topology"], lambda: train_inside(mine, 1, 0.0, topology=[[0], [1]]))
    e = hvd.add_process_set([0, 1, 3])  # every rank, but without its groups
    if e.included():
        expect_error(RuntimeError, ["(0, ", "add_process_set_groups", "every rank"], lambda: train_inside(e, 1, 0.0))


def check_fp16_keeps_small_updates():
    """As torch_process_sets.py: updates below half of fp16's spacing at 1.0 are kept, and every rank stays
    within fp16's error on the differences of its group's exact mean."""
    size, lr, steps = hvd.size(), 5e-5, 12
    model = model_at(1.0, width=8)
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(lr), compression=hvd.Compression.fp16, model=model,
                                   global_every=3, **SCHEDULE)
    grads = np.arange(1.0, size + 1, dtype=np.float32)
    step = stepper(model, opt, float(grads[RANK]))
    kernel = model.trainable_variables[0]
    reference = None
    for t in range(steps):
        now = hvd.allgather(tf.reshape(kernel[0, 0], [1]), name="test_fp16_now").numpy()
        before = (now - np.float32(lr) * grads).astype(np.float64)
        action = opt._dssync.plan.action(t)
        step()
        got = np.concatenate([v.numpy().ravel() for v in model.trainable_variables]).astype(np.float64)
        if reference is None:
            want = before.mean()
            check(np.abs(got - want).max() <= 1e-7, f"step {t}: reference average {got[:2]}, want {want}")
        else:
            group = [opt._dssync._scope.to_global(action.group)] if action.kind == "group" else [range(size)]
            group = list(group[0])
            want = before[group].mean()
            bound = 8 * 2.0 ** -11 * np.abs(before[group] - reference).max() + 1e-6
            check(np.abs(got - want).max() <= bound, f"step {t}: {got[:2]} is more than {bound} from {want}")
        if reference is None or action.kind == "global":
            reference = float(hvd.allreduce(tf.constant(got.mean()), name="test_fp16_reference"))
    mean = float(hvd.allreduce(tf.constant(got.mean()), name="test_fp16_mean"))
    want = 1.0 - lr * steps * grads.mean()
    check(abs(mean - want) < 1e-5, f"fp16: the ranks' mean is {mean}, want {want} (rounded weights stay at 1.0)")


def main():
    global RANK
    hvd.init()
    RANK, _ = common.identify(hvd)
    check(hvd.size() == 4, "run this job on 4 ranks")
    sets = [hvd.add_process_set(s) for s in ([1, 2, 3], [0], [0, 2], [1, 3])]
    for s in sets:
        dss.add_process_set_groups(s, sync=SYNC)
    check_process_sets(sets)
    check_fp16_keeps_small_updates()
    hvd.allreduce(tf.zeros(1), name="test_end")
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
