"""One rank of a job that adds, uses and removes Horovod process sets while unnamed global ops go on, with
the build's dynamic process sets agreed on one cycle in ``HOROVOD_DYNAMIC_PROCESS_SETS_CHECK_EVERY``
(scripts/patch_horovod.py): every rank must still agree on each set, whatever cycle its ranks reach the
call on. Every check raises on failure, so a failing rank fails the launch.
"""
import os
import time

import common
import horovod.torch as hvd
import torch
from common import check

RANK, SIZE = common.init_with_dynamic_sets(hvd)
check(os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS_CHECK_EVERY") is not None, "the test sets the cycle count")

started = time.monotonic()
for round_ in range(6):
    if RANK == round_ % SIZE:
        time.sleep(0.2)  # one rank reaches the registration late, on another cycle than the others
    pairs = [[r, (r + 1 + round_) % SIZE] for r in range(SIZE)]
    sets = []
    for pair in pairs:
        pair = sorted(set(pair))
        if len(pair) < SIZE and pair not in [s.ranks for s in sets]:
            sets.append(hvd.add_process_set(pair))
    for ps in sets:
        if ps.included():
            total = hvd.allreduce(torch.tensor([float(RANK)]), op=hvd.Sum, process_set=ps,
                                  name=f"test.set.{round_}.{ps.process_set_id}")
            check(total.item() == float(sum(ps.ranks)), f"round {round_}: set {ps.ranks} summed {total.item()}")
    everyone = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)  # unnamed: the same op sequence everywhere
    check(everyone.item() == SIZE, f"round {round_}: {everyone.item()}")
    for ps in sets:
        hvd.remove_process_set(ps)
print(f"rank {RANK}: 6 rounds of sets added, used and removed in {time.monotonic() - started:.1f} s: "
      "all checks passed", flush=True)
