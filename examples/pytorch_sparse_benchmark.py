"""Embedding-heavy model: Horovod's sparse gradient path, Horovod with sparse_as_dense, DS-Sync dense and
DS-Sync sparse, side by side in one job.

A DeepFM-style click model on synthetic data: 26 categorical fields with power-law (Zipf) ids hashed
into one ``nn.Embedding(rows, 16, sparse=True)`` table, a first-order weight per id, the FM pairwise
interaction and a small MLP. Labels come from a hidden model of the same shape, so the loss can fall.
Each variant trains the same model from the same start for ``--steps`` steps, one after the other in
this job, with plain SGD. Rank 0 prints one markdown row per variant: median step, bytes sent per step
(DS-Sync: ``last_sync["bytes_sent"]``; Horovod: a ring allreduce or allgather of what it sends), rows in
play, the final training loss, the AUC of rank 0's model on held-out clicks, and with ``--target-loss`` the
training seconds until rank 0's mean loss over 10 steps fell below it::

    horovodrun -np 4 -H localhost:4 --gloo python examples/pytorch_sparse_benchmark.py
"""
import argparse
import time

import horovod.torch as hvd
import hvd_dssync.torch as dss
import numpy as np
import torch
from sklearn.metrics import roc_auc_score

FIELDS, WIDTH = 26, 16
HELD_OUT, HELD_OUT_SEED = 8192, 999  # clicks no rank trains on, drawn as the training ones


class ClickModel(torch.nn.Module):
    def __init__(self, rows, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Embedding(rows, WIDTH, sparse=True)
        self.linear = torch.nn.Embedding(rows, 1, sparse=True)
        torch.nn.init.normal_(self.embedding.weight, std=0.01)
        torch.nn.init.zeros_(self.linear.weight)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(FIELDS * WIDTH, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, ids):
        e = self.embedding(ids)  # batch x fields x width
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        return self.linear(ids).sum((1, 2)) + fm + self.mlp(e.flatten(1)).squeeze(1)


def batches(rows, batch, seed, steps):
    """Power-law ids per field (field k's ids live in their own slice of the hashed table)."""
    rng = np.random.default_rng(seed)
    per_field = rows // FIELDS
    truth = np.random.default_rng(12345).normal(size=rows).astype(np.float32)
    offsets = np.arange(FIELDS) * per_field
    for _ in range(steps):
        ids = (np.minimum(rng.zipf(1.2, size=(batch, FIELDS)) - 1, per_field - 1) + offsets).astype(np.int64)
        logits = truth[ids].sum(1) / np.sqrt(FIELDS)
        labels = (rng.random(batch) < 1 / (1 + np.exp(-logits))).astype(np.float32)
        yield torch.from_numpy(ids), torch.from_numpy(labels)


def held_out_auc(model, rows):
    """The AUC of ``model``'s scores on the held-out clicks."""
    ids, labels = next(batches(rows, HELD_OUT, HELD_OUT_SEED, 1))
    with torch.no_grad():
        return float(roc_auc_score(labels.numpy(), model(ids).numpy()))


def ring_bytes(n, nbytes):
    return 2 * (n - 1) * nbytes // n


def run(variant, args):
    model = ClickModel(args.rows)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    named = model.named_parameters()
    if variant.startswith("horovod"):
        opt = hvd.DistributedOptimizer(opt, named_parameters=named, sparse_as_dense=variant.endswith("dense"))
    else:
        opt = dss.DistributedOptimizer(opt, named_parameters=named, global_every=args.global_every,
                                       sparse_average=variant.endswith("sparse"))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    times, sent, in_play, losses = [], [], [], []
    n = hvd.size()
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reached = None  # (seconds of training, step) when the mean loss of the last 10 steps fell below the target
    for t, (ids, labels) in enumerate(batches(args.rows, args.batch, 1000 + hvd.rank(), args.steps)):
        started = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(ids), labels)
        loss.backward()
        if variant == "horovod-sparse":
            # Horovod allgathers the sparse gradients' indices and values; the dense layers are allreduced.
            sparse = sum(p.grad._nnz() * (p.grad._values()[0].numel() * 4 + 8) for p in model.parameters()
                         if p.grad.is_sparse)
            rest = sum(p.numel() * 4 for p in model.parameters() if not p.grad.is_sparse)
            sent.append(sparse * (n - 1) + ring_bytes(n, rest))
        opt.step()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
        if reached is None and args.target_loss and len(losses) >= 10 and np.mean(losses[-10:]) < args.target_loss:
            reached = (float(np.sum(times)), t)
        if variant == "horovod-sparse-as-dense":
            sent.append(ring_bytes(n, dense_bytes))
        elif variant.startswith("dssync"):
            sent.append(opt.last_sync["bytes_sent"])
            if "row_set" in opt.last_sync:
                in_play.append(opt.last_sync["row_set"])
    skip = min(5, args.steps // 4)  # the first steps warm caches and start Horovod's cycle
    return {"variant": variant, "step_ms": 1000 * float(np.median(times[skip:])),
            "mb_per_step": float(np.mean(sent[skip:])) / 1e6, "loss": float(np.mean(losses[-10:])),
            "rows_in_play": (int(np.median(in_play)), int(max(in_play))) if in_play else None, "reached": reached,
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
    torch.set_num_threads(1)
    hvd.init()
    results = [run(v, args) for v in args.variants.split(",")]
    if hvd.rank() == 0:
        print(f"\n{hvd.size()} ranks, {args.rows} x {WIDTH} table + {args.rows} x 1, batch {args.batch}, "
              f"{args.steps} steps, SGD lr {args.lr}, DS-Sync default groups, global_every={args.global_every}\n")
        print("| variant | median step (ms) | MB sent per step (rank 0) | rows in play (both tables), median / max | "
              f"loss, last 10 steps | s to loss < {args.target_loss or '-'} (step) | held-out AUC |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in results:
            play = "-" if r["rows_in_play"] is None else "%d / %d" % r["rows_in_play"]
            reached = "-" if r["reached"] is None else "%.1f (%d)" % r["reached"]
            print(f"| {r['variant']} | {r['step_ms']:.1f} | {r['mb_per_step']:.2f} | {play} | {r['loss']:.4f} "
                  f"| {reached} | {r['auc']:.4f} |")


if __name__ == "__main__":
    main()
