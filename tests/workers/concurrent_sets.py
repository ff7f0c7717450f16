"""One rank of a 4-rank job in which two process sets work at once: ranks 0 and 1 average a large tensor
in set A while ranks 2 and 3 run many small averages in set B. With the build's concurrent process sets
(scripts/patches/concurrent-process-sets.patch) set B's averages all finish while set A's is still in
flight under Gloo, its first ones under MPI; in Horovod as released every rank's background loop waits for
A's op, so B's finish after it, from the first.

Prints ``B FINISHED FIRST`` or ``B WAITED FOR A`` (all of B's averages against A's), and ``B BEGAN BESIDE A``
or ``B BEGAN AFTER A`` (B's first average within the first half of A's or not), on rank 0, and checks every value. ``--big`` sets
A's tensor (floats), ``--small-ops`` B's count.
"""
import argparse
import time

import common
import horovod.torch as hvd
import torch
from common import check

parser = argparse.ArgumentParser()
parser.add_argument("--big", type=int, default=150_000_000)
parser.add_argument("--small-ops", type=int, default=30)
args = parser.parse_args()

RANK, SIZE = common.init_with_dynamic_sets(hvd, 4)
set_a = hvd.add_process_set([0, 1])
set_b = hvd.add_process_set([2, 3])

big = torch.full((args.big,), float(RANK + 1))
# Each set's communicators warmed up (connections open), then every rank at the same point.
hvd.allreduce(torch.zeros(1000), process_set=set_a if RANK < 2 else set_b, name="warm")
hvd.allreduce(torch.zeros(1), name="start")
started = time.monotonic()
first = 0.0  # when B's first average finished (ranks 2 and 3)
if RANK in (0, 1):
    out = hvd.allreduce(big, op=hvd.Sum, process_set=set_a, name="a.big")
    check(out[0].item() == 3.0 and out[-1].item() == 3.0, f"set A summed {out[0].item()}")
else:
    time.sleep(0.05)  # A's op is on the wire
    for k in range(args.small_ops):
        out = hvd.allreduce(torch.tensor([float(RANK + k)]), op=hvd.Sum, process_set=set_b, name=f"b.{k}")
        check(out.item() == float(5 + 2 * k), f"set B op {k} summed {out.item()}")
        if k == 0:
            first = time.monotonic() - started
finished = time.monotonic() - started
times = hvd.allgather(torch.tensor([[finished, first]]), name="times").tolist()
a_done, b_done = max(times[0][0], times[1][0]), max(times[2][0], times[3][0])
b_first = max(times[2][1], times[3][1])
if RANK == 0:
    verdict = "B FINISHED FIRST" if b_done < a_done else "B WAITED FOR A"
    # B's first average against the first half of A's: a loop that waits for A completes B's first op in the
    # cycle after A's, which may be read before A's ranks wake from their own wait (3.17 s against 3.17 s).
    began = "B BEGAN BESIDE A" if b_first < a_done / 2 else "B BEGAN AFTER A"
    print(f"set A's {args.big * 4 / 1e6:.0f} MB average took {a_done:.2f} s; set B's {args.small_ops} averages "
          f"finished at {b_done:.2f} s, its first at {b_first:.2f} s: {verdict}; {began}", flush=True)
print(f"rank {RANK}: all checks passed", flush=True)
