"""One rank of a small deterministic DS-Sync Keras run, for the failure and checkpoint jobs.

Modes, as ``reliability_train.py`` (the PyTorch one):
- ``kill --at K``: rank 1 kills itself (SIGKILL) at step K; the others train on until Horovod fails them.
- ``stall --at K``: rank 1 stops calling Horovod at step K (alive, but silent).
- ``full --steps N --dir D``: train N steps, save each rank's weights at the end.
- ``save --steps K --dir D``: train K steps, save each rank's whole model with its optimizer (.keras).
- ``resume --steps N --dir D``: load it with ``dss.load_model``, train on to step N, compare bit for bit
  with ``full``.

Each rank's batch at step t is drawn from a generator seeded by (rank, t).
"""
import argparse
import os
import signal
import time

import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf

tf.config.experimental.enable_op_determinism()
OPTIONS = dict(num_groups=2, seed=11, warmup_steps=2, global_every=5)


def build():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input(shape=(6,)), tf.keras.layers.Dense(16),
                                 tf.keras.layers.BatchNormalization(), tf.keras.layers.ReLU(),
                                 tf.keras.layers.Dense(1)])
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), model=model, **options())
    model.compile(optimizer=opt, loss="mse")
    return model


def options():
    return dict(OPTIONS, num_groups=min(2, hvd.size()))


def batch(step):
    rng = np.random.default_rng(1000 * hvd.rank() + step)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    return x, np.sin(x.sum(axis=1, keepdims=True))


def train(model, first, last):
    for step in range(first, last):
        if ARGS.mode in ("kill", "stall") and step == ARGS.at and hvd.rank() == 1:
            print(f"rank 1: {ARGS.mode} at step {step}", flush=True)
            if ARGS.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        model.train_on_batch(*batch(step))


def path(what):
    return os.path.join(ARGS.dir, f"keras-{what}.rank{hvd.rank()}")


def main():
    hvd.init()
    if ARGS.mode in ("kill", "stall"):
        train(build(), 0, 10_000)
    elif ARGS.mode == "full":
        model = build()
        train(model, 0, ARGS.steps)
        np.savez(path("full") + ".npz", *model.get_weights())
    elif ARGS.mode == "save":
        model = build()
        train(model, 0, ARGS.steps)
        model.save(path("checkpoint") + ".keras")
    else:
        model = dss.load_model(path("checkpoint") + ".keras", **options())
        resumed_at = model.optimizer.sync_step
        train(model, resumed_at, ARGS.steps)
        full = np.load(path("full") + ".npz")
        expected = [full[f"arr_{i}"] for i in range(len(full.files))]
        got = model.get_weights()
        assert all(np.array_equal(a, b) for a, b in zip(got, expected)), \
            f"rank {hvd.rank()}: resumed weights differ from the uninterrupted run's"
        print(f"rank {hvd.rank()}: resumed at step {resumed_at}, equal to the uninterrupted run at step "
              f"{ARGS.steps}", flush=True)
    hvd.allreduce(tf.constant(0.0), name="reliability.keras.end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("kill", "stall", "full", "save", "resume"))
    parser.add_argument("--at", type=int, default=10)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--dir", default=".")
    ARGS = parser.parse_args()
    main()
