"""One rank of the concurrent process sets' stress job (8 ranks): overlapping sets used at once, ops of
several steps in flight together, sets added and removed while other sets' ops are in flight. Every value is
checked; a hang is the launcher's timeout. ``--rounds`` sets the length. With ``--ordered`` every set is
marked ordered (patch level 9: its allreduces skip the negotiation), and its ops are the allreduces it allows.
"""
import argparse
import time

import common
import horovod.torch as hvd
import torch
from common import check

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=12)
parser.add_argument("--ordered", action="store_true")
args = parser.parse_args()

RANK, SIZE = common.init_with_dynamic_sets(hvd, 8, job="the stress job")
FIXED = [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [1, 2], [3, 4], [5, 6], [0, 7]]
sets = [hvd.add_process_set(ranks) for ranks in FIXED]
mine = [ps for ps in sets if ps.included()]


def ordered(ps):
    """Mark ``ps`` ordered with ``--ordered`` (on every rank, before its first op); True where it is now."""
    if not args.ordered:
        return False
    from hvd_dssync.process_sets import mark_ordered

    done = mark_ordered(ps)
    check(done == ps.included(), f"set {ps.ranks} marked ordered: {done}")
    return done


for ps in sets:
    ordered(ps)


def submit(round_, ps):
    """This rank's ops of one round in one set: an allreduce, a grouped allreduce, an allgather and a
    broadcast, each with what it must return."""
    tag = f"r{round_}.s{ps.process_set_id}"
    value = float(RANK + round_)
    expected_sum = float(sum(ps.ranks) + round_ * len(ps.ranks))
    root = ps.ranks[round_ % len(ps.ranks)]
    reduced = [
        (hvd.allreduce_async(torch.full((1000,), value), op=hvd.Sum, process_set=ps, name=tag + ".ar"),
         lambda out: out[0].item() == expected_sum and out[-1].item() == expected_sum),
        (hvd.grouped_allreduce_async([torch.full((10,), value), torch.full((300,), 2 * value)], op=hvd.Sum,
                                     process_set=ps, name=tag + ".gar"),
         lambda out: out[0][0].item() == expected_sum and out[1][-1].item() == 2 * expected_sum),
    ]
    if args.ordered:  # an ordered set carries allreduces only: a third, of float64, instead of the others
        return reduced + [
            (hvd.grouped_allreduce_async([torch.full((5,), value, dtype=torch.float64), torch.full((20,), value)],
                                         op=hvd.Average, process_set=ps, name=tag + ".mixed"),
             lambda out: out[0][0].item() == expected_sum / len(ps.ranks) and out[1][3].item() == out[0][0].item()),
        ]
    return reduced + [
        (hvd.allgather_async(torch.full((2, 3), value), process_set=ps, name=tag + ".ag"),
         lambda out: out[:, 0].tolist() == [float(r + round_) for r in ps.ranks for _ in range(2)]),
        (hvd.broadcast_async(torch.full((50,), value), root_rank=root, process_set=ps, name=tag + ".bc"),
         lambda out: out[7].item() == float(root + round_)),
    ]


started = time.monotonic()
pending = []
for round_ in range(args.rounds):
    for ps in mine:
        pending.append((round_, ps.ranks, submit(round_, ps)))
    if round_ % 3 == 1:
        # A set added and removed while the ops of this round and the last are in flight.
        extra = hvd.add_process_set([r for r in range(SIZE) if r % 2 == round_ % 2] if round_ % 2 == 0
                                    else [0, 3, 5, 6])
        ordered(extra)
        if extra.included():
            total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=extra, name=f"extra.{round_}")
            check(total.item() == len(extra.ranks), f"round {round_}: extra set summed {total.item()}")
        hvd.remove_process_set(extra)
    # Two rounds in flight at once: wait for the older one.
    while pending and pending[0][0] < round_:
        old_round, ranks, ops = pending.pop(0)
        for handle, valid in ops:
            check(valid(hvd.synchronize(handle)), f"round {old_round}: set {ranks} returned a wrong value")
for old_round, ranks, ops in pending:
    for handle, valid in ops:
        check(valid(hvd.synchronize(handle)), f"round {old_round}: set {ranks} returned a wrong value")
everyone = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="everyone")
check(everyone.item() == SIZE, f"the global set summed {everyone.item()}")
for ps in sets:
    hvd.remove_process_set(ps)
print(f"rank {RANK}: {args.rounds} rounds in {time.monotonic() - started:.1f} s: all checks passed", flush=True)
hvd.shutdown()
