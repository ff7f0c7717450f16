"""One rank of a Keras job where every rank builds an optimizer restricted to the even ranks' process set.

As with Horovod's Keras ``DistributedOptimizer``: the even ranks train together (their models stay equal),
the odd ranks build the optimizer too, send nothing and train alone with ``model.fit`` (their models
differ); on them ``backward_passes_per_step`` still sums passes and ``scale_local_gradients`` still divides
a local variable's gradient by the set's size. A bad argument raises the same error on every rank, members
or not. Every check raises on failure, so a failing rank fails the launch.
"""
import common
import horovod.tensorflow as hvd_tf  # the collectives with process_set and allgather_object
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf
from common import check, check_alike, fail

hvd.init()
RANK, SIZE = common.identify(hvd)
even_set, odd_set, mine = common.even_and_odd_sets(hvd)
outside = mine is odd_set

# Bad arguments: the same errors on members and non-members, before anything is sent.
messages = []
for bad in (dict(backward_passes_per_step=0), dict(schedule="no-such-schedule"), dict(model="not a model")):
    try:
        dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), process_set=even_set, **bad)
        fail(f"{bad} was accepted")
    except (ValueError, TypeError) as error:
        messages.append(str(error))
gathered = hvd_tf.allgather_object(messages, name="test.keras_outside.errors")
check_alike(gathered, f"errors differ between ranks: {gathered}")

# Training: the same start everywhere, each rank its own data.
tf.random.set_seed(0)
model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(8, activation="relu"),
                             tf.keras.layers.Dense(4)])
opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.2, momentum=0.9), process_set=even_set)
check(opt.process_set is even_set, "the optimizer does not report its process set")
check(type(opt).__name__ == "SGD" and isinstance(opt, tf.keras.optimizers.SGD), "not of the user's class")
model.compile(optimizer=opt, loss="mse")
rng = np.random.default_rng(RANK)
x, y = rng.normal(size=(48, 10)).astype("float32"), rng.normal(size=(48, 4)).astype("float32")
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
check(int(opt.iterations.numpy()) == 3, f"iterations {int(opt.iterations.numpy())} after 3 batches")

if mine is even_set and even_set.size() > 2:
    dss.synchronize_models(model, process_set=even_set)  # groups of the set: equal after an exact average
weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
everyone = hvd_tf.allgather(tf.constant(weights)[None], process_set=mine,
                           name="test.keras_outside.weights").numpy()
common.check_outside_weights(everyone, weights, mine, even_set, lambda a, b: np.allclose(a, b, atol=1e-6))

if outside:
    # Horovod's step outside its set: passes summed, a local variable's gradient divided by the set's size.
    passes = dss.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), process_set=even_set,
                                      backward_passes_per_step=2)
    local, shared = tf.Variable([0.0]), tf.Variable([0.0])
    passes.register_local_var(local)

    @tf.function
    def train_pass():
        passes.apply_gradients([(tf.constant([1.0]), local), (tf.constant([float(RANK)]), shared)])

    train_pass()
    check(local.numpy()[0] == 0.0 and shared.numpy()[0] == 0.0, "the first of two passes stepped")
    train_pass()
    want = -2.0 / even_set.size()
    check(np.isclose(local.numpy()[0], want), f"local variable {local.numpy()}, want {want}")
    check(np.isclose(shared.numpy()[0], -2.0 * RANK), f"shared variable {shared.numpy()}, want {-2.0 * RANK}")
    check(int(passes.iterations.numpy()) == 2 and passes.sync_step == 1, "passes not counted as Horovod's")
else:
    # The members build the same optimizers in the same order (their op names are numbered alike).
    dss.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), process_set=even_set, backward_passes_per_step=2)

# A global optimizer built after the set's one: its op names match on every rank.
opt_all = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), num_groups=1)
v = tf.Variable([float(RANK)])


@tf.function
def global_step():
    opt_all.apply_gradients([(tf.constant([0.0]), v)])


global_step()
check(np.isclose(v.numpy()[0], (SIZE - 1) / 2.0), f"global average {v.numpy()}, want {(SIZE - 1) / 2.0}")

# The ranks outside trained alone and sent nothing, as with Horovod, so a global op after training is named
# (Horovod names an unnamed op by how many ops this process issued).
total = hvd_tf.allreduce(tf.constant([1.0]), op=hvd_tf.Sum, name="test.keras_outside.after").numpy()
check(total[0] == SIZE, f"allreduce after training gave {total}")
print(f"rank {RANK}: all checks passed", flush=True)
