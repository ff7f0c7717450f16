"""One rank of a Keras job across emulated hosts of several ranks each, launched by horovodrun or mpirun.

As multihost_torch.py: Horovod's host layout, the default's racks from the hosts, each step's group means
inside one traced ``fit`` (waited for), training, and consensus after synchronize_models.
"""
import sys

import common
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf
from common import averaged, check, crosses_hosts, step_groups
from hvd_dssync.config import RACK_GLOBAL_EVERY

hvd.init()
RANK, SIZE = common.identify(hvd)
SLOTS = int(sys.argv[1])
STEPS = RACK_GLOBAL_EVERY + 4  # the default averages in the racks on racks, across them in its global average

layout, hosts = common.check_host_layout(hvd, hvd_tf.allgather_object, SLOTS)

# Group means with the defaults, every average waited for (the default's trial sends the global averages in flight from
# the end of its set-up period on: tests/workers/keras_overlap_hosts.py), inside fit: every rank starts at its rank;
# lr 0 leaves only the averaging.
model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2)])
for v in model.variables:
    v.assign(tf.fill(v.shape, float(RANK)))
opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), overlap=False)
model.compile(optimizer=opt, loss="mse")
sensed = common.check_sensed_hosts(opt._dssync.sensed, SIZE, SLOTS)
plan, values, history = opt._dssync.plan, [float(r) for r in range(SIZE)], []
for t in range(STEPS):
    kind, groups = step_groups(plan, t, SIZE)
    values = averaged(values, groups)
    history.append((values[RANK], kind, groups))
crossing = [t for t, (_, kind, groups) in enumerate(history) if crosses_hosts(groups, SLOTS)]
check(crossing, f"no step averaged across hosts in {STEPS} steps: {history}")


class CheckEachStep(tf.keras.callbacks.Callback):
    step = 0

    def on_train_batch_end(self, batch, logs=None):
        want, kind, groups = history[self.step]
        for v in self.model.variables:
            got = v.numpy().reshape(-1)
            check(np.allclose(got, want, atol=1e-5),
                  f"step {self.step} ({kind}, groups {groups}): {v.name} holds {got.tolist()}, want {want}")
        self.step += 1


checker = CheckEachStep()
x = np.random.default_rng(RANK).normal(size=(4 * STEPS, 3)).astype(np.float32)
model.fit(x, np.zeros((4 * STEPS, 2), np.float32), batch_size=4, epochs=1, shuffle=False, verbose=0,
          callbacks=[checker])
check(checker.step == STEPS and opt.sync_step == STEPS, f"steps {checker.step}, sync_step {opt.sync_step}")

# Training on each rank's own data, then consensus.
rng = np.random.default_rng(100 + RANK)
x = rng.normal(size=(64, 5)).astype(np.float32)
y = x.sum(axis=1, keepdims=True)
tf.keras.utils.set_random_seed(RANK)
model = tf.keras.Sequential([tf.keras.Input(shape=(5,)), tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(1)])
model.compile(optimizer=dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)), loss="mse")
losses = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history["loss"]
check(all(np.isfinite(losses)), f"losses {losses}")
check(dss.consensus_distance(model) > 0, "models trained on different data should differ")
dss.synchronize_models(model)
flat = np.concatenate([v.numpy().reshape(-1) for v in model.variables])
rows = hvd_tf.allgather_object(flat, name="test.weights")
common.check_consensus(rows, np.array_equal, dss.consensus_distance(model), "synchronize_models")
print(f"rank {RANK} on {hosts[RANK]}: layout {layout}, steps across hosts {crossing}, sensed {sensed.get('how')} "
      f"{sensed.get('racks')}, loss {losses[0]:.3f} -> {losses[-1]:.3f}: all checks passed", flush=True)
