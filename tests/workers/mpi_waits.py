"""One rank of an 8-rank MPI job on fewer cores: every rank computes, then averages with its pair, ``--ops``
times (every average checked); then odd ranks wait ``--wait`` seconds in an average for their partners,
which sleep meanwhile. Prints, on rank 0, the CPU time the waiting ranks spent per second of waiting.

A blocking MPI call waits by polling (with mpi_yield_when_idle, a sched_yield between polls), so where
ranks outnumber cores a waiting rank takes the cores from the ranks with work; the build's sleeping MPI
waits (scripts/patches/sleeping-mpi-waits.patch) sleep between polls instead.
"""
import argparse
import resource
import time

import common
import horovod.torch as hvd
import torch
from common import check

parser = argparse.ArgumentParser()
parser.add_argument("--ops", type=int, default=20)
parser.add_argument("--wait", type=float, default=1.0)
args = parser.parse_args()

RANK, SIZE = common.init_with_dynamic_sets(hvd, 8)
pairs = [hvd.add_process_set([2 * k, 2 * k + 1]) for k in range(SIZE // 2)]
mine = pairs[RANK // 2]
weights = torch.randn(256, 256)
hvd.allreduce(torch.zeros(1), name="start")
for ops in range(args.ops):
    for _ in range(20):  # a step's compute
        weights = torch.tanh(weights @ weights) * 0.5
    out = hvd.allreduce(torch.full((65536,), float(RANK)), op=hvd.Sum, process_set=mine, name=f"pair.{ops}")
    check(out[0].item() == float(4 * (RANK // 2) + 1), f"pair average {ops} summed {out[0].item()}")


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


hvd.allreduce(torch.zeros(1), name="before the wait")
before = cpu_seconds()
if RANK % 2 == 0:
    time.sleep(args.wait)  # not on a core: the partner's wait is all that could take one
out = hvd.allreduce(torch.full((4,), float(RANK)), op=hvd.Sum, process_set=mine, name="waited")
check(out[0].item() == float(4 * (RANK // 2) + 1), f"the waited average summed {out[0].item()}")
waited = torch.tensor([cpu_seconds() - before if RANK % 2 else 0.0])
spent = hvd.allreduce(waited, op=hvd.Sum, name="cpu").item()  # the waiting ranks' CPU seconds
if RANK == 0:
    waiting = SIZE // 2
    print(f"{waiting} ranks waited {args.wait:.1f} s each for their partners; CPU time they spent waiting, "
          f"per second of waiting: WAIT CPU {spent / (waiting * args.wait):.3f}", flush=True)
print(f"rank {RANK}: all checks passed", flush=True)
