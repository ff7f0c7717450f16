"""One rank of the Keras saving job: a model compiled with DS-Sync saves and loads (h5, SavedModel, .keras),
and the loaded optimizer continues the schedule where it stopped.

Every rank trains with lr=0 from its own rank-valued weights, so after step t its weights must equal the
schedule's group mean; the check continues across the save/load boundary.
"""
import os
import tempfile

import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from common import check, expected_values
from keras_semantics import RANK, SIZE, CheckEachStep, rank_valued_model

FORMATS = ("h5", "savedmodel", "keras")


def data(steps):
    x = np.random.default_rng(RANK).normal(size=(4 * steps, 3)).astype(np.float32)
    return x, np.zeros((4 * steps, 2), np.float32)


def check_round_trip(fmt, directory, steps=3):
    options = {"num_groups": min(2, SIZE), "seed": 11, "global_every": 4}
    model = rank_valued_model()
    model.compile(optimizer=dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), model=model, **options), loss="mse")
    history = expected_values(model.optimizer._dssync.plan, SIZE, 2 * steps)
    x, y = data(steps)
    checker = CheckEachStep(history, f"{fmt} before saving")
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False, callbacks=[checker])
    path = os.path.join(directory, {"h5": "model.h5", "savedmodel": "model", "keras": "model.keras"}[fmt])
    os.makedirs(directory, exist_ok=True)
    model.save(path)
    weights = [v.numpy() for v in model.variables]

    plain = tf.keras.models.load_model(path)
    check(not hasattr(plain.optimizer, "_dssync"), f"{fmt}: plain load_model gave a DS-Sync optimizer")
    check(isinstance(plain.optimizer, tf.keras.optimizers.SGD), f"{fmt}: plain load gave {plain.optimizer}")
    check(all(np.array_equal(a, v.numpy()) for a, v in zip(weights, plain.variables)), f"{fmt}: weights changed")

    loaded = dss.load_model(path, **options)
    check(hasattr(loaded.optimizer, "_dssync"), f"{fmt}: dss.load_model gave {type(loaded.optimizer)}")
    check(isinstance(loaded.optimizer, tf.keras.optimizers.SGD), f"{fmt}: the optimizer is no longer an SGD")
    check(all(np.array_equal(a, v.numpy()) for a, v in zip(weights, loaded.variables)), f"{fmt}: weights changed")
    check(loaded.optimizer.sync_step == steps,
          f"{fmt}: the loaded optimizer is at step {loaded.optimizer.sync_step}, want {steps}")
    checker.model = None
    checker.what = f"{fmt} after loading"
    loaded.fit(x, y, batch_size=4, verbose=0, shuffle=False, callbacks=[checker])
    check(checker.step == 2 * steps, f"{fmt}: {checker.step} steps checked")


def main():
    with tempfile.TemporaryDirectory(prefix=f"dssync-keras-rank{RANK}-") as directory:
        for fmt in FORMATS:
            check_round_trip(fmt, os.path.join(directory, fmt))
    hvd.allreduce(tf.constant(1.0), name="test.done")
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
