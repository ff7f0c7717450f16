"""One worker of a Keras elastic job (horovodrun --host-discovery-script): DS-Sync under hvd.elastic.run.

Usage: keras_elastic.py HOSTFILE EPOCHS CHANGE_AT NEW_HOSTS [--state dssync|horovod]

``model.fit`` trains 2 steps per epoch, with Horovod's UpdateEpochStateCallback and CommitStateCallback
(a commit at each epoch's end). At the end of epoch CHANGE_AT, rank 0 rewrites the host file to NEW_HOSTS;
the discovery script reads it and Horovod removes or adds a worker at a later commit. With
``--state dssync`` (``hvd_dssync.keras.elastic.KerasState``) every worker must finish all epochs in the
new world: the schedule rebuilt for its size, the same step and groups on every rank (a newcomer's step is
rank 0's), and the last step's groups exactly averaged with process sets of the new world. With
``--state horovod`` (Horovod's KerasState, which keeps the traced step) the old graph must stop with
hvd_dssync's error instead of hanging.
"""
import argparse
import time

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("hostfile")
parser.add_argument("epochs", type=int)
parser.add_argument("change_at", type=int)
parser.add_argument("new_hosts")
parser.add_argument("--state", choices=("dssync", "horovod"), default="dssync")
ARGS = parser.parse_args()
STEPS_PER_EPOCH = 2

hvd.init()
first_size = hvd.size()
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(8, activation="relu"),
                             tf.keras.layers.Dense(1)])
opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9), group_size=2, seed=5)
model.compile(optimizer=opt, loss="mse")
# A joining worker's optimizer variables (momentum slots) must match the others' when the state syncs them.
opt.build(model.trainable_variables)
State = dss.elastic.KerasState if ARGS.state == "dssync" else hvd.elastic.KerasState
state = State(model, epoch=0)
sizes_seen = []


class Watch(tf.keras.callbacks.Callback):
    """Records the world sizes, checks the step at each epoch's end, and changes the host file once."""

    def on_epoch_begin(self, epoch, logs=None):
        if hvd.size() not in sizes_seen:
            sizes_seen.append(hvd.size())

    def on_epoch_end(self, epoch, logs=None):
        # UpdateEpochStateCallback (before this one) counted the epoch just finished.
        if opt.sync_step != state.epoch * STEPS_PER_EPOCH:
            raise AssertionError(f"rank {hvd.rank()}: DS-Sync step {opt.sync_step} after epoch {state.epoch}")
        if state.epoch == ARGS.change_at and hvd.rank() == 0 and hvd.size() == first_size:
            with open(ARGS.hostfile, "w") as f:
                f.write(ARGS.new_hosts + "\n")
        time.sleep(0.3)  # leave the discovery script (polled each second) time to see the change


def data():
    rng = np.random.default_rng(100 + hvd.rank())
    x = rng.normal(size=(8 * STEPS_PER_EPOCH, 4)).astype(np.float32)
    return x, np.sin(x.sum(axis=1, keepdims=True))


@hvd.elastic.run
def train(state):
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=ARGS.epochs - state.epoch, shuffle=False, verbose=0,
              callbacks=[hvd.elastic.UpdateEpochStateCallback(state), Watch(),
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=10 ** 9)])


try:
    train(state)
except tf.errors.InvalidArgumentError as e:
    if ARGS.state == "horovod" and "hvd_dssync: this step was traced for a Horovod world of" in e.message:
        reason = next(line for line in e.message.splitlines() if "hvd_dssync:" in line).strip()
        print(f"rank {hvd.rank()}: the stale step stopped with hvd_dssync's error: {reason}",
              flush=True)
        raise SystemExit(3)
    raise

plan = opt._dssync.plan
steps = hvd_tf.allgather_object(opt.sync_step, name="test.elastic.steps")
groups = hvd_tf.allgather_object([opt.schedule.groups(t) for t in range(8)], name="test.elastic.groups")
if plan.world_size != hvd.size() or plan.rank != hvd.rank() or len(set(steps)) != 1 or \
        any(g != groups[0] for g in groups):
    raise AssertionError(f"rank {hvd.rank()}: after the world changed, plan for rank {plan.rank} of "
                         f"{plan.world_size} in a world of {hvd.size()}, steps {steps}, groups agree: "
                         f"{all(g == groups[0] for g in groups)}")
if steps[0] != ARGS.epochs * STEPS_PER_EPOCH:
    raise AssertionError(f"rank {hvd.rank()}: finished at step {steps[0]}, not {ARGS.epochs * STEPS_PER_EPOCH}")
# The last step averaged inside its group of the new world: its members hold the same weights.
flat = np.concatenate([w.ravel() for w in model.get_weights()])
weights = hvd_tf.allgather_object(flat, name="test.elastic.weights")
group = opt.schedule.group_of(hvd.rank(), opt.sync_step - 1)
if any(not np.allclose(weights[r], flat, rtol=1e-6, atol=1e-7) for r in group):
    raise AssertionError(f"rank {hvd.rank()}: the last step's group {group} does not hold one average")
dss.synchronize_models(model)
distance = dss.consensus_distance(model)
print(f"rank {hvd.rank()}: sizes {sizes_seen}, finished at step {opt.sync_step} in a world of {hvd.size()}, "
      f"last group {list(group)} averaged, consensus distance {distance:.1f}", flush=True)
