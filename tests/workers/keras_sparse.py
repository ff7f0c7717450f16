"""One rank of a 4-rank Keras job: embedding tables averaged by their rows equal dense averaging.

The same seeded run twice, with ``sparse_average`` and without: a Keras ``Embedding`` (its gradients are
``IndexedSlices``) and a dense head, SGD, pairs that shuffle every step, a bulk-synchronous warm-up, a
global average every 5 steps, and every rank saving its own model half way and loading it into a fresh
one (its ranks then differ, so the row sets must start full). After every step the two runs' models must
be equal: bit for bit up to the first global average (a pair's average is one addition either way), and
within float32 rounding after it (a 4-rank sum adds in an order that depends on where a value lies in the
fused buffer). The sparse run must count far fewer bytes. Then the optimizers: Adagrad and the legacy
SGD's lazy momentum are averaged by rows; Adam, whose moments move every row, densely with a warning; and
ranks that start from different tables (Horovod's recipe broadcasts after the first batch) start from
full row sets, then empty ones. Every check raises on failure.
"""
import os
import tempfile
import warnings

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import numpy as np
import tensorflow as tf
from common import check
from keras_semantics import RANK, progress, user_unnamed_ops

ROWS, WIDTH, STEPS, RESUME_AT, BATCH = 2000, 8, 30, 14, 16
OPTIONS = {"num_groups": 2, "seed": 3, "warmup_steps": 2, "global_every": 5, "sparse_as_dense": True}


def build_model():
    """The same initial model on every rank and in every run."""
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,), dtype="int32"),
                                 tf.keras.layers.Embedding(ROWS, WIDTH, name="embedding"),
                                 tf.keras.layers.GlobalAveragePooling1D(),
                                 tf.keras.layers.Dense(1, name="head")])
    rng = np.random.default_rng(0)
    for v in model.variables:
        v.assign(rng.normal(scale=0.3, size=v.shape).astype(np.float32))
    return model


def data(steps, seed=100):
    """Power-law ids, a different stream per rank; the same in both runs."""
    rng = np.random.default_rng(seed + RANK)
    ids = np.minimum(rng.zipf(1.3, size=(BATCH * steps, 4)) - 1, ROWS - 1).astype(np.int32)
    return ids, rng.normal(size=(BATCH * steps, 1)).astype(np.float32)


class Record(tf.keras.callbacks.Callback):
    """The table and the head's kernel after every step."""

    def __init__(self, states):
        super().__init__()
        self.states = states

    def on_train_batch_end(self, batch, logs=None):
        self.states.append((self.model.get_layer("embedding").embeddings.numpy(),
                            self.model.get_layer("head").kernel.numpy()))


def fit(model, x, y, states, sent):
    stats = dss.callbacks.SyncStatsCallback()
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[stats, Record(states)])
    sent.append(history.history["dssync_bytes_sent"][-1])
    return history


def train(sparse, directory, make=lambda: tf.keras.optimizers.SGD(0.5), options=OPTIONS, steps=STEPS,
          resume_at=RESUME_AT):
    """Every step's (table, head kernel), the bytes counted, and the optimizer of the last part."""
    x, y = data(steps)
    model = build_model()
    model.compile(optimizer=dss.DistributedOptimizer(make(), sparse_average=sparse, **options), loss="mse")
    states, sent = [], []
    fit(model, x[:BATCH * resume_at], y[:BATCH * resume_at], states, sent)
    if resume_at < steps:
        path = os.path.join(directory, f"{'sparse' if sparse else 'dense'}-{RANK}.h5")
        model.save(path)
        model = dss.load_model(path, sparse_average=sparse, **options)
        check(model.optimizer.sync_step == resume_at, f"resumed at step {model.optimizer.sync_step}")
        fit(model, x[BATCH * resume_at:], y[BATCH * resume_at:], states, sent)
    return states, sum(sent), model.optimizer


def check_sparse_equals_dense(directory):
    progress("sparse equals dense")
    sparse, sparse_bytes, opt = train(True, directory)
    dense, dense_bytes, dense_opt = train(False, directory)
    check(opt._dssync.sparse.row_sets is not None, "the sparse run did not average the table by rows")
    check(dense_opt._dssync.sparse.row_sets is None, "sparse_average=False averaged the table by rows")
    plan = opt._dssync.plan
    first_global = next(t for t in range(STEPS) if plan.action(t).kind == "global")
    for t, ((table, head), (dense_table, dense_head)) in enumerate(zip(sparse, dense)):
        if t < first_global:
            check(np.array_equal(table, dense_table) and np.array_equal(head, dense_head),
                  f"step {t}: sparse and dense averaging differ before any global average "
                  f"(max {np.abs(table - dense_table).max()})")
        else:
            np.testing.assert_allclose(table, dense_table, rtol=1e-5, atol=1e-6, err_msg=f"rank {RANK} step {t}")
            np.testing.assert_allclose(head, dense_head, rtol=1e-5, atol=1e-6, err_msg=f"rank {RANK} step {t}")
    check(len(sparse) == STEPS, f"{len(sparse)} steps recorded")
    check(0 < 3 * sparse_bytes < dense_bytes, f"sparse averaging counted {sparse_bytes} bytes, dense {dense_bytes}")
    moved = [t for t in range(1, STEPS) if not np.array_equal(sparse[t][0], sparse[t - 1][0])]
    check(len(moved) > STEPS // 2, f"the table moved at steps {moved} only")


def check_optimizers(directory):
    progress("optimizers")
    no_warmup = {"num_groups": 2, "seed": 3, "global_every": 4}
    for make, by_rows in [(lambda: tf.keras.optimizers.Adagrad(0.5), True),
                          (lambda: tf.keras.optimizers.legacy.SGD(0.5, momentum=0.9), True),
                          (lambda: tf.keras.optimizers.Adam(0.05), False),
                          (lambda: tf.keras.optimizers.SGD(0.5, momentum=0.9), False)]:
        name = type(make()).__name__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sparse, sparse_bytes, opt = train(True, directory, make, no_warmup, steps=10, resume_at=10)
        warned = [str(w.message) for w in caught if "averaged densely" in str(w.message)]
        check((opt._dssync.sparse.row_sets is not None) == by_rows, f"{name}: averaged by rows is not {by_rows}")
        check(bool(warned) != by_rows, f"{name}: warnings {warned}")
        dense, dense_bytes, _ = train(False, directory, make, no_warmup, steps=10, resume_at=10)
        for t, ((table, head), (dense_table, dense_head)) in enumerate(zip(sparse, dense)):
            np.testing.assert_allclose(table, dense_table, rtol=1e-5, atol=1e-6, err_msg=f"{name} step {t}")
            np.testing.assert_allclose(head, dense_head, rtol=1e-5, atol=1e-6, err_msg=f"{name} step {t}")
        if by_rows:
            check(3 * sparse_bytes < dense_bytes, f"{name}: {sparse_bytes} bytes by rows, {dense_bytes} dense")
    legacy_warmup = {**no_warmup, "warmup_steps": 1, "sparse_as_dense": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, opt = train(True, directory, lambda: tf.keras.optimizers.legacy.SGD(0.5, momentum=0.9), legacy_warmup,
                          steps=3, resume_at=3)
    check(opt._dssync.sparse.row_sets is None and any("dense" in str(w.message) for w in caught),
          "the legacy SGD's momentum with dense (warm-up) gradients was averaged by rows")


def check_ranks_start_apart():
    """Rank-valued tables, broadcast after the first batch as in Horovod's recipe: full sets, then empty."""
    progress("ranks start apart")
    model = build_model()
    model.get_layer("embedding").embeddings.assign(tf.fill([ROWS, WIDTH], float(RANK)))
    model.compile(optimizer=dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), num_groups=2, seed=3), loss="mse")
    sizes = []

    class Sets(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            sizes.append(self.model.optimizer._dssync.sparse.row_sets.total())

    x, y = data(3, seed=7)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Sets()])
    check(sizes[0] == ROWS, f"the first step's row set is {sizes[0]} rows, not the whole table")
    check(0 < sizes[1] < ROWS // 4, f"after the broadcast the row set is {sizes[1]} rows")
    table = model.get_layer("embedding").embeddings.numpy()
    gathered = hvd_tf.allgather_object(table, name="test.sparse.tables")
    check(all(np.array_equal(t, gathered[0]) for t in gathered), "lr=0 after a broadcast left the tables apart")


def main():
    with tempfile.TemporaryDirectory() as directory:
        check_sparse_equals_dense(directory)
        check_optimizers(directory)
    check_ranks_start_apart()
    user_unnamed_ops()
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
