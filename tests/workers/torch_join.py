"""One rank of a 4-rank PyTorch job with uneven data: Horovod's ``hvd.join()`` recipe under DS-Sync.

Rank ``r`` has ``BATCHES + 3 r`` batches per epoch, so ranks run out of data at different steps and call
``hvd.join()``, as Horovod's docs say to. Each configuration trains two such epochs (the second joins
again after the first reset) and checks after each join:

- every rank returns from ``join()`` at the same DS-Sync step, and names the same last rank to join
  (rank 3, which has the most batches);
- a joined rank kept averaging with its groups while it waited: its model moved without a local update;
- unnamed Horovod ops after ``join()`` still pair up (every rank issued the same ops meanwhile).

Configurations: the default groups (pairs for 4 ranks) with a bulk-synchronous warm-up, global averages
and the embedding averaged sparsely; the topology-aware schedule with local steps, overlap and ranks alone
in their group; fp16 compression, whose first average is over all ranks. A hang fails the launch's timeout; every check raises on failure.
"""
import common
import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(); hvd.join is DS-Sync's from here on
import torch
from common import check
from hvd_dssync.schedules import TopologyAware
from hvd_dssync.topology import Topology
from torch_sparse import Model  # an nn.Embedding(sparse=True) table and a dense head (this folder)

BATCHES, EPOCHS = 5, 2
RANK = SIZE = None


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def epoch(model, opt, epoch_number):
    generator = torch.Generator().manual_seed(1000 * epoch_number + RANK)
    for _ in range(BATCHES + 3 * RANK):
        ids = torch.randint(0, 200, (8, 3), generator=generator)
        target = torch.randn(8, generator=generator)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
    before, step_before = flat(model), opt.sync_step
    last = hvd.join()
    steps = hvd.allgather(torch.tensor([opt.sync_step])).tolist()
    check(len(set(steps)) == 1, f"ranks left join() at different steps: {steps}")
    lasts = hvd.allgather(torch.tensor([last])).tolist()
    check(lasts == [SIZE - 1] * SIZE, f"join() named {lasts} as the last rank to join, not {SIZE - 1}")
    if RANK == 0:
        check(opt.sync_step > step_before, f"rank 0 served no step: {step_before} -> {opt.sync_step}")
        check(not torch.equal(before, flat(model)), "rank 0's model did not move while it waited in join()")
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)  # unnamed: pairs up only if the op counts agree
    check(total.item() == SIZE, f"unnamed allreduce after join() gave {total.item()}")
    return steps[0]


def train(name, **kwargs):
    model = Model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = dss.DistributedOptimizer(base, named_parameters=model.named_parameters(), model=model, **kwargs)
    left = [epoch(model, opt, k) for k in range(EPOCHS)]
    dss.synchronize_models(model)
    check(dss.consensus_distance(model) == 0.0, f"{name}: models differ after synchronize_models")
    if RANK == 0:
        print(f"{name}: every rank left join() together at steps {left}", flush=True)


def main():
    global RANK, SIZE
    hvd.init()
    RANK, SIZE = common.identify(hvd)
    check(SIZE == 4, "run with 4 ranks")
    train("default groups, warm-up, global averages", seed=1, warmup_steps=2, global_every=5,
          sparse_as_dense=True)
    topology = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]), intra_steps=1, rotate_every=None)
    train("topology, local steps, overlap", schedule=topology, average_every=2, overlap=True)
    train("shuffle, fp16 compression", seed=2, sparse_average=False, compression=hvd.Compression.fp16)
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
