"""Embedding-heavy Keras model: Horovod's sparse gradient path, Horovod with sparse_as_dense, DS-Sync dense and
DS-Sync sparse, side by side in one job (the Keras twin of ``pytorch_sparse_benchmark.py``).

The same DeepFM-style click model on the same synthetic data: 26 categorical fields with power-law (Zipf)
ids hashed into one ``Embedding(rows, 16)`` table (its gradients are ``IndexedSlices``), a first-order
weight per id, the FM pairwise interaction and a small MLP, trained with ``model.fit`` and plain SGD. Each
variant trains the same model from the same start for ``--steps`` steps, one after the other in this job.
Rank 0 prints one markdown row per variant: median step, bytes sent per step (DS-Sync: its
``SyncStatsCallback``; Horovod: the allgather of every looked-up row's gradient and id, as Horovod sends
them, or a ring allreduce), rows in play at the end, the final training loss, the AUC of rank 0's model on
held-out clicks, and with ``--target-loss`` the training seconds until rank 0's mean loss over 10 steps fell below it::

    horovodrun -np 4 -H localhost:4 --gloo python examples/keras_sparse_benchmark.py
"""
import argparse
import time

import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from sklearn.metrics import roc_auc_score

FIELDS, WIDTH = 26, 16
HELD_OUT, HELD_OUT_SEED = 8192, 999  # clicks no rank trains on, drawn as the training ones


def click_model(rows):
    ids = tf.keras.Input(shape=(FIELDS,), dtype="int64")
    e = tf.keras.layers.Embedding(rows, WIDTH, name="embedding")(ids)  # batch x fields x width
    first_order = tf.keras.layers.Embedding(rows, 1, name="linear")(ids)
    fm = 0.5 * tf.reduce_sum(tf.square(tf.reduce_sum(e, 1)) - tf.reduce_sum(tf.square(e), 1), 1, keepdims=True)
    hidden = tf.keras.layers.Dense(64, activation="relu")(tf.keras.layers.Flatten()(e))
    logit = tf.reduce_sum(first_order, 1) + fm + tf.keras.layers.Dense(1)(hidden)
    model = tf.keras.Model(ids, logit)
    rng = np.random.default_rng(0)  # the same start on every rank and for every variant
    for v in model.variables:
        scale = 0.0 if v.name.startswith("linear") else (0.01 if v.name.startswith("embedding") else 0.1)
        v.assign(rng.normal(scale=scale, size=v.shape).astype(v.dtype.as_numpy_dtype))
    return model


def data(rows, batch, seed, steps):
    """Power-law ids per field (field k's ids live in their own slice of the hashed table), as the PyTorch twin."""
    rng = np.random.default_rng(seed)
    per_field = rows // FIELDS
    truth = np.random.default_rng(12345).normal(size=rows).astype(np.float32)
    offsets = np.arange(FIELDS) * per_field
    ids = (np.minimum(rng.zipf(1.2, size=(batch * steps, FIELDS)) - 1, per_field - 1) + offsets).astype(np.int64)
    logits = truth[ids].sum(1) / np.sqrt(FIELDS)
    labels = (rng.random(batch * steps) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return ids, labels[:, None]


def held_out_auc(model, rows):
    """The AUC of ``model``'s scores on the held-out clicks (as the PyTorch twin's)."""
    ids, labels = data(rows, HELD_OUT, HELD_OUT_SEED, 1)
    return float(roc_auc_score(labels.ravel(), model(ids, training=False).numpy().ravel()))


def ring_bytes(n, nbytes):
    return 2 * (n - 1) * nbytes // n


class StepClock(tf.keras.callbacks.Callback):
    """Each step's wall time and loss (Keras logs the epoch's running mean; the step's is recovered from it)."""

    def __init__(self):
        super().__init__()
        self.times, self.losses, self._mean = [], [], 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._started)
        mean = float(logs["loss"])
        self.losses.append(mean * (batch + 1) - self._mean * batch)
        self._mean = mean


def run(variant, args, x, y):
    model = click_model(args.rows)
    opt = tf.keras.optimizers.SGD(args.lr)
    if variant.startswith("horovod"):
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=variant.endswith("dense"))
    else:
        opt = dss.DistributedOptimizer(opt, global_every=args.global_every, sparse_average=variant.endswith("sparse"))
    model.compile(optimizer=opt, loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    clock, stats = StepClock(), dss.callbacks.SyncStatsCallback()
    callbacks = [clock] + ([stats] if variant.startswith("dssync") else [])
    history = model.fit(x, y, batch_size=args.batch, shuffle=False, verbose=0, callbacks=callbacks)
    n, steps = hvd.size(), args.steps
    dense_bytes = sum(v.shape.num_elements() * 4 for v in model.trainable_variables)
    if variant == "horovod-sparse":
        # Horovod allgathers the IndexedSlices' values and int64 ids, one per lookup; the rest is allreduced.
        tables = {"embedding": WIDTH, "linear": 1}
        sparse = sum(args.batch * FIELDS * (width * 4 + 8) for width in tables.values())
        rest = sum(v.shape.num_elements() * 4 for v in model.trainable_variables
                   if not any(v.name.startswith(t) for t in tables))
        per_step = sparse * (n - 1) + ring_bytes(n, rest)
    elif variant == "horovod-sparse-as-dense":
        per_step = ring_bytes(n, dense_bytes)
    else:
        per_step = history.history["dssync_bytes_sent"][-1] / steps
    in_play = history.history.get("dssync_row_set", [None])[-1]
    reached = None
    for t in range(10, steps + 1):
        if args.target_loss and np.mean(clock.losses[t - 10:t]) < args.target_loss:
            reached = (float(np.sum(clock.times[:t])), t - 1)
            break
    skip = min(5, steps // 4)  # the first steps trace the step and start Horovod's cycle
    return {"variant": variant, "step_ms": 1000 * float(np.median(clock.times[skip:])), "mb_per_step": per_step / 1e6,
            "loss": float(np.mean(clock.losses[-10:])), "rows_in_play": in_play, "reached": reached,
            "auc": held_out_auc(model, args.rows)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the hashed embedding table")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--global-every", type=int, default=16, help="DS-Sync's global averages")
    parser.add_argument("--variants", default="horovod-sparse,horovod-sparse-as-dense,dssync-dense,dssync-sparse")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="report the training seconds until rank 0's mean loss over 10 steps is below this")
    args = parser.parse_args()
    hvd.init()
    x, y = data(args.rows, args.batch, 1000 + hvd.rank(), args.steps)
    results = [run(v, args, x, y) for v in args.variants.split(",")]
    if hvd.rank() == 0:
        print(f"\nKeras, {hvd.size()} ranks, {args.rows} x {WIDTH} table + {args.rows} x 1, batch {args.batch}, "
              f"{args.steps} steps, SGD lr {args.lr}, DS-Sync default groups, global_every={args.global_every}\n")
        print("| variant | median step (ms) | MB sent per step (rank 0) | rows in play (both tables), at the end | "
              f"loss, last 10 steps | s to loss < {args.target_loss or '-'} (step) | held-out AUC |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in results:
            play = "-" if r["rows_in_play"] is None else "%d" % r["rows_in_play"]
            reached = "-" if r["reached"] is None else "%.1f (%d)" % r["reached"]
            print(f"| {r['variant']} | {r['step_ms']:.1f} | {r['mb_per_step']:.2f} | {play} | {r['loss']:.4f} "
                  f"| {reached} | {r['auc']:.4f} |")


if __name__ == "__main__":
    main()
