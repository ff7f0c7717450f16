"""One rank of an 8-rank MPI job on fewer cores: every rank computes, then averages with its pair, ``--ops``
times. Prints, on rank 0, the job's CPU time in the kernel against its CPU time in user code, and checks
every average.

A blocking MPI call waits by polling (with mpi_yield_when_idle, a sched_yield between polls), so where
ranks outnumber cores the waiting ranks' kernel time takes the cores from the ranks with work; the build's
sleeping MPI waits (scripts/patches/sleeping-mpi-waits.patch) sleep between polls instead. ``--seconds``
sets the number of averages.
"""
import argparse
import resource
import time

import common
import horovod.torch as hvd
import torch
from common import check

parser = argparse.ArgumentParser()
parser.add_argument("--ops", type=int, default=150)
args = parser.parse_args()

RANK, SIZE = common.init_with_dynamic_sets(hvd, 8)
pairs = [hvd.add_process_set([2 * k, 2 * k + 1]) for k in range(SIZE // 2)]
mine = pairs[RANK // 2]
weights = torch.randn(256, 256)
hvd.allreduce(torch.zeros(1), name="start")
before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
for ops in range(args.ops):
    for _ in range(20):  # a step's compute
        weights = torch.tanh(weights @ weights) * 0.5
    out = hvd.allreduce(torch.full((65536,), float(RANK)), op=hvd.Sum, process_set=mine, name=f"pair.{ops}")
    check(out[0].item() == float(4 * (RANK // 2) + 1), f"pair average {ops} summed {out[0].item()}")
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = torch.tensor([[after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime]])
user, kernel = hvd.allgather(cpu, name="cpu").sum(0).tolist()
if RANK == 0:
    print(f"{args.ops} averages per rank in {time.monotonic() - started:.1f} s; CPU time in user code {user:.1f} s, "
          f"in the kernel {kernel:.1f} s: KERNEL/USER {kernel / user:.2f}", flush=True)
print(f"rank {RANK}: all checks passed", flush=True)
