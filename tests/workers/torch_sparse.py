"""One rank of a 4-rank PyTorch job: sparse averaging of embedding tables equals dense averaging.

The same seeded run twice, with sparse averaging and without: an ``nn.Embedding(sparse=True)`` table and
a dense layer, SGD with momentum (its sparse buffer keeps moving rows that the step's gradient did not
touch), pairs that shuffle every step, a bulk-synchronous warm-up, a global average every 5 steps, and a
checkpoint saved and loaded on every rank half way. After every step the two runs' models must be equal:
bit for bit up to the first global average (a pair's average is one addition, the same either way), and
within float32 rounding after it (a 4-rank sum adds in an order that depends on where a value lies in the
fused buffer). The sparse run must send far fewer bytes. Then the optimizers: Adagrad is averaged
sparsely; an optimizer that moves rows it does not report (a dense momentum buffer) is averaged densely,
with a warning. Last, ranks alone in their group at a sparse step must issue as many Horovod ops as the
others, or a script's unnamed allreduce waits forever. Every check raises on failure.
"""
import itertools
import warnings

import common
import horovod.torch as hvd
import hvd_dssync.torch as dss
import numpy as np
import torch
from common import check
from hvd_dssync.schedules import TopologyAware
from hvd_dssync.topology import Topology

ROWS, WIDTH, STEPS, RESUME_AT = 2000, 8, 30, 14
RANK = None


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(ROWS, WIDTH, sparse=True)
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, ids):
        return self.head(self.embedding(ids).mean(1)).squeeze(1)


def batches(rank):
    """The same batches in both runs: power-law ids, a different stream per rank."""
    rng = np.random.default_rng(100 + rank)
    for _ in range(STEPS):
        ids = np.minimum(rng.zipf(1.3, size=(16, 4)) - 1, ROWS - 1)
        yield torch.from_numpy(ids), torch.from_numpy(rng.normal(size=16).astype(np.float32))


def build(model, sparse):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), num_groups=2, seed=3,
                                    warmup_steps=2, global_every=5, sparse_as_dense=True, sparse_average=sparse)


def train(sparse):
    """Every step's (table, head weight) and the bytes and rows of every average."""
    model = Model()
    opt = build(model, sparse)
    states, sent, rows, kinds = [], 0, [], []
    for t, (ids, target) in enumerate(batches(hvd.rank())):
        if t == RESUME_AT:
            saved = (model.state_dict(), opt.state_dict())
            model = Model()
            opt = build(model, sparse)
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
        states.append((model.embedding.weight.detach().clone(), model.head.weight.detach().clone()))
        sent += opt.last_sync["bytes_sent"]
        rows.append(opt.last_sync.get("sparse_rows"))
        kinds.append(opt.last_sync["kind"])
    return states, sent, rows, kinds


def main():
    global RANK
    hvd.init()
    RANK, _ = common.identify(hvd)
    check(hvd.size() == 4, "run with 4 ranks")
    sparse, sparse_bytes, rows, kinds = train(True)
    dense, dense_bytes, dense_rows, _ = train(False)
    check(all(r is None for r in dense_rows), f"sparse_rows reported with sparse_average=False: {dense_rows}")
    first_global = kinds.index("global")
    for t, ((table, head), (table_d, head_d)) in enumerate(zip(sparse, dense)):
        gap = max(float((table - table_d).abs().max()), float((head - head_d).abs().max()))
        if t < first_global:
            check(gap == 0.0, f"step {t} ({kinds[t]}): sparse and dense models differ by {gap}")
        else:
            check(gap <= 1e-5, f"step {t} ({kinds[t]}): sparse and dense models differ by {gap}")
    group_rows = [r for r, k in zip(rows, kinds) if k == "group"]
    check(all(r is not None and 0 < r < ROWS for r in group_rows), f"rows averaged at group steps: {group_rows}")
    check(sparse_bytes * 3 < dense_bytes, f"sparse sent {sparse_bytes} bytes, dense {dense_bytes}")

    # Adagrad moves only the rows of the gradient; a dense momentum buffer moves every row, so that table is
    # averaged densely, with a warning.
    model = Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), num_groups=2, seed=3)
    ids, target = next(batches(hvd.rank()))
    torch.nn.functional.mse_loss(model(ids), target).backward()
    opt.step()
    check(opt.last_sync["sparse_rows"] > 0, f"Adagrad is averaged sparsely: {opt.last_sync}")
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), num_groups=2, seed=3)
    opt.state[model.embedding.weight]["momentum_buffer"] = torch.zeros(ROWS, WIDTH)  # moves every row
    torch.nn.functional.mse_loss(model(ids), target).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    check(any("averaged densely" in str(w.message) for w in caught), f"no warning: {[str(w.message) for w in caught]}")
    check("sparse_rows" not in opt.last_sync, f"a dense momentum buffer still averaged sparsely: {opt.last_sync}")

    # A rank alone in its group issues as many Horovod ops as a member of a sparse group (which gathers the
    # row sets, then averages), so that a script's unnamed ops keep the same names on every rank: with a
    # different count, the unnamed allreduce below waits forever for its namesake.
    model = Model()
    schedule = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]), intra_steps=1, rotate_every=None)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), schedule=schedule)
    for ids, target in itertools.islice(batches(hvd.rank()), 4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
        total = float(hvd.allreduce(torch.ones(1), op=hvd.Sum)[0])  # unnamed, as scripts' metrics often are
        check(total == 4.0, f"unnamed allreduce after a {opt.last_sync['kind']} step gave {total}")
    check(schedule.groups(1) == ((0,), (1, 3), (2,)), f"the bridge step has no rank alone: {schedule.groups(1)}")

    # The default on racks sends its global averages through them where nothing stands in the way
    # (global_via_bridges="auto"); beside sparse averaging it averages over every rank at once instead of
    # refusing: every rank then holds the same model.
    model = Model()
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   topology=[[0, 1], [2, 3]], average_every=2, global_every=4,
                                   schedule_options={"intra_steps": None, "global_via_bridges": "auto"})
    for ids, target in itertools.islice(batches(hvd.rank()), 4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
    check(opt.last_sync["kind"] == "global" and opt.last_sync.get("sparse_rows", 0) > 0,
          f"the 4th step is a global average of the rows: {opt.last_sync}")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvd.allgather(flat.unsqueeze(0), name="test.auto.weights")
    check(all(torch.allclose(rows[0], row, atol=1e-6) for row in rows), "the models differ after the global average")
    print(f"rank {RANK}: sparse {sparse_bytes} bytes, dense {dense_bytes} bytes; all checks passed", flush=True)


if __name__ == "__main__":
    main()
