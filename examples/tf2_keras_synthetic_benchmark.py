"""Synthetic throughput benchmark for Keras, in the style of Horovod's tensorflow2_keras_synthetic_benchmark.py.

Measures the time of one ``model.fit`` training step (forward, backward, optimizer step with its
synchronization) on random data, with Horovod's optimizer or, with ``--dssync``, with DS-Sync's::

    horovodrun -np 4 -H localhost:4 python examples/tf2_keras_synthetic_benchmark.py
    horovodrun -np 4 -H localhost:4 python examples/tf2_keras_synthetic_benchmark.py --dssync --num-groups 2

The model is an MLP of about ``--params`` million parameters (Horovod's uses ResNet-50 on images; an
MLP keeps the compute small, so that the synchronization shows). Same arguments and output as
``pytorch_synthetic_benchmark.py``.
"""
import argparse
import json
import time

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): DS-Sync registers Horovod process sets
import numpy as np
import tensorflow as tf


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dssync", action="store_true", help="use DS-Sync instead of hvd.DistributedOptimizer")
    parser.add_argument("--schedule", default="shuffle", choices=("shuffle", "butterfly"))
    parser.add_argument("--num-groups", type=int, default=2, help="groups per step (shuffle)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression of what is averaged")
    parser.add_argument("--params", type=float, default=1.0, help="model size in millions of parameters")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--json", help="append the result as one JSON line to this file (rank 0)")
    return parser.parse_args()


def make_model(million_params):
    width = int((million_params * 1e6 / 2) ** 0.5)
    return tf.keras.Sequential([tf.keras.Input(shape=(256,)), tf.keras.layers.Dense(width, activation="relu"),
                                tf.keras.layers.Dense(width, activation="relu"), tf.keras.layers.Dense(10)])


class StepTimer(tf.keras.callbacks.Callback):
    """Seconds per step of each epoch (an epoch is ``--num-batches-per-iter`` steps)."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append((time.perf_counter() - self.started) / self.steps)


def main():
    args = parse_args()
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = make_model(args.params)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = tf.keras.optimizers.SGD(0.01)
    if args.dssync:
        optimizer = dss.DistributedOptimizer(optimizer, compression=compression, schedule=args.schedule,
                                             num_groups=min(args.num_groups, hvd.size())
                                             if args.schedule == "shuffle" else None)
        name = f"dssync-{args.schedule}"
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, compression=compression)
        name = "horovod"
    model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    data = tf.random.uniform([args.batch_size, 256])
    target = tf.random.uniform([args.batch_size], minval=0, maxval=10, dtype=tf.int64)
    dataset = tf.data.Dataset.from_tensors((data, target)).repeat()

    # Warm-up: trace the train function and let every rank's first steps pass.
    model.fit(dataset, steps_per_epoch=args.num_warmup_batches, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    timer = StepTimer(args.num_batches_per_iter)
    model.fit(dataset, steps_per_epoch=args.num_batches_per_iter, epochs=args.num_iters, verbose=0,
              callbacks=[timer])

    step_ms = 1000 * float(np.median(timer.times))
    # Every rank's median, so the slowest rank shows (a global collective: no rank exits early).
    slowest = float(hvd_tf.allreduce(tf.constant(step_ms), op=hvd_tf.Max, name="bench_slowest").numpy())
    params = model.count_params()
    if hvd.rank() == 0:
        print(f"{name}: {hvd.size()} ranks, {params / 1e6:.2f}M parameters, median step {step_ms:.2f} ms "
              f"(slowest rank {slowest:.2f} ms), {args.batch_size * hvd.size() / slowest * 1000:.0f} samples/s")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"name": name, "ranks": hvd.size(), "params": params, "step_ms": step_ms,
                                    "slowest_rank_step_ms": slowest, "framework": "keras"}) + "\n")


if __name__ == "__main__":
    main()
