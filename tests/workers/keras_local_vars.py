"""One rank of a 2-rank Keras job: ``register_local_var`` as in Horovod's Keras optimizer.

The scenario of Horovod's gradient-aggregation test with local variables: an optimizer whose update is
``var += grad``; eight scalar variables x_i and eight two-element y_i, the first four of each registered
local; the loss ``x - (rank + 1) * y[:, 0]`` (a gather from each y, so y's gradient is sparse); four backward passes
per step, ``sparse_as_dense``, with and without ``average_aggregated_gradients``. Each pass runs
``_compute_gradients`` then ``apply_gradients`` in one ``tf.function``, and after each the variables must
equal the closed form: local variables step by their own summed gradient divided by the world size
(``scale_local_gradients``) and stay apart between ranks; the others by the ranks' mean gradient, which
DS-Sync's one group of the whole world at 2 ranks gives exactly. Every check raises on failure.
"""
import common
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss
import numpy as np
import tensorflow as tf
from common import check

hvd.init()
RANK, SIZE = common.identify(hvd)
PASSES, STEPS, COUNT, LOCAL = 4, 10, 8, 4


class AddGradient(tf.keras.optimizers.Optimizer):
    """``var += grad``: the applied gradient is read off the variables."""

    def __init__(self, name="add_gradient", **kwargs):
        super().__init__(name=name, **kwargs)
        self._learning_rate = self._build_learning_rate(0.1)

    def update_step(self, gradient, variable):
        variable.assign_add(gradient)


def expected(passes_done, average_aggregated):
    """x and y after ``passes_done`` passes on this rank, in closed form."""
    steps = passes_done // PASSES
    per_step = 1.0 if average_aggregated else float(PASSES)  # one pass's gradient, summed or averaged
    mean_rank_factor = (SIZE + 1) / 2.0  # the mean of (r + 1) over the ranks
    x = np.array([steps * per_step / (SIZE if i < LOCAL else 1) for i in range(COUNT)])
    y0 = np.array([1.0 - steps * per_step * ((RANK + 1) / SIZE if i < LOCAL else mean_rank_factor)
                   for i in range(COUNT)])
    return x.reshape(-1, 1), np.stack([y0, np.full(COUNT, 2.0)], axis=1)


def run(average_aggregated):
    opt = dss.DistributedOptimizer(AddGradient(), backward_passes_per_step=PASSES,
                                   average_aggregated_gradients=average_aggregated, sparse_as_dense=True,
                                   name=f"local_vars_{average_aggregated}")
    check(opt.scale_local_gradients is True, "scale_local_gradients is not Horovod's default")
    xs = [tf.Variable([0.0]) for _ in range(COUNT)]
    ys = [tf.Variable([1.0, 2.0]) for _ in range(COUNT)]
    for i in range(LOCAL):
        opt.register_local_var(xs[i])
        opt.register_local_var(ys[i])
    check(len(opt._agg_helper._local_vars) == 2 * LOCAL, "the aggregation helper misses the local variables")
    variables = xs + ys

    def loss():
        # Each y gathered itself: Horovod's test gathers from the stacked y's, whose gradients come out dense.
        return tf.stack(xs) - float(RANK + 1) * tf.stack([tf.gather(y, [0]) for y in ys])

    @tf.function
    def train_pass():
        grads_and_vars = opt._compute_gradients(loss, var_list=variables)
        opt.apply_gradients(grads_and_vars, experimental_aggregate_gradients=False)

    sparse = [g for g, _ in opt._compute_gradients(loss, var_list=variables)[COUNT:]]
    check(all(isinstance(g, tf.IndexedSlices) for g in sparse), f"y's gradients are not sparse: {sparse[:1]}")
    for t in range(STEPS):
        train_pass()
        want_x, want_y = expected(t + 1, average_aggregated)
        got_x, got_y = np.array(xs), np.array(ys)
        check(np.allclose(got_x, want_x), f"average_aggregated={average_aggregated} pass {t}: x {got_x.ravel()}, "
                                          f"want {want_x.ravel()}")
        check(np.allclose(got_y, want_y), f"average_aggregated={average_aggregated} pass {t}: y {got_y.tolist()}, "
                                          f"want {want_y.tolist()}")
        check(int(opt.iterations.numpy()) == t + 1, f"iterations {int(opt.iterations.numpy())} after pass {t}")
    # The local y's had different gradients on each rank and were not averaged: they differ between ranks.
    gathered = hvd.allgather(tf.constant(np.array(ys))[None], name=f"local_vars_check_{average_aggregated}").numpy()
    check(not np.allclose(gathered[0][:LOCAL], gathered[1][:LOCAL]), "local variables were averaged")
    check(np.allclose(gathered[0][LOCAL:], gathered[1][LOCAL:]), "shared variables differ between ranks")
    check(opt.sync_step == STEPS // PASSES, f"sync_step {opt.sync_step}")


def scale_off():
    """``scale_local_gradients=False``: a local variable's gradient is applied whole."""
    opt = dss.DistributedOptimizer(AddGradient(), scale_local_gradients=False, name="local_vars_unscaled")
    local, shared = tf.Variable([0.0]), tf.Variable([0.0])
    opt.register_local_var(local)

    @tf.function
    def step():
        opt.apply_gradients([(tf.constant([float(RANK + 1)]), local), (tf.constant([float(RANK + 1)]), shared)])

    step()
    check(np.allclose(local.numpy(), RANK + 1), f"unscaled local variable {local.numpy()}")
    check(np.allclose(shared.numpy(), (SIZE + 1) / 2.0), f"shared variable {shared.numpy()}")


check(SIZE == 2, "this worker expects 2 ranks (the default schedule's one group is then the whole world)")
for average_aggregated in (False, True):
    run(average_aggregated)
scale_off()
total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="local_vars_after").numpy()
check(total[0] == SIZE, f"allreduce after training gave {total}")
print(f"rank {RANK}: all checks passed", flush=True)
