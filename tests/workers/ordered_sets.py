"""One rank of a 4-rank job on ordered process sets (scripts/patches/ordered-process-sets.patch): sets {0, 1}
and {2, 3} marked ordered run grouped allreduces straight on their executors, with no negotiation.

Checks: marking says whether the set is now ordered (``--expect-ordered 0`` where the switch
``HOROVOD_ORDERED_PROCESS_SETS=0`` is on, or on a build without it); grouped averages of mixed dtypes, larger
than the fusion buffer (the job runs with a 1 MB threshold), give the exact means, several in flight at once;
a mismatch (another shape, another tensor count, another name) fails on both members with the same error
naming the set, within seconds, ``--failing-ops`` such failed ops in a row do not hang, and the set works again
after them; an allgather on an ordered set is refused; unnamed ops and the global set are unaffected. Prints
one line of seconds per op on rank 0.
"""
import argparse
import time

import common
import horovod.torch as hvd
import torch
from common import check, fail
from hvd_dssync.process_sets import mark_ordered

parser = argparse.ArgumentParser()
parser.add_argument("--expect-ordered", type=int, default=1)
parser.add_argument("--ops", type=int, default=40)
parser.add_argument("--failing-ops", type=int, default=300)
args = parser.parse_args()

RANK, SIZE = common.init_with_dynamic_sets(hvd, 4)
sets = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])]
mine, other = sets[RANK // 2], sets[1 - RANK // 2]
marked = mark_ordered(mine)
check(marked == bool(args.expect_ordered), f"marking the set returned {marked}, want {bool(args.expect_ordered)}")
check(not mark_ordered(other), "a set this rank is not in was marked ordered here")
check(not mark_ordered(hvd.global_process_set), "the global set was marked ordered")
partner = RANK ^ 1


# Grouped averages: float32 and float64, 3 MB in all against a 1 MB fusion buffer, several in flight at once.
shapes = [(200_000,), (3, 5), (300_000,), (7,), (250_000,)]
dtypes = [torch.float32, torch.float32, torch.float64, torch.float64, torch.float32]


def tensors(rank, k):
    return [torch.full(shape, float(rank * 10 + k + i), dtype=dtype) for i, (shape, dtype) in enumerate(zip(shapes,
                                                                                                            dtypes))]


def check_average(k, handle):
    """Op ``k``'s tensors, once done: the mean of this rank's and its partner's."""
    for i, out in enumerate(hvd.synchronize(handle)):
        want = (RANK * 10 + partner * 10) / 2 + k + i
        check(bool((out == want).all()), f"op {k} tensor {i}: {out.flatten()[0].item()} != {want}")


started = time.perf_counter()
handles = []
for k in range(args.ops):
    handles.append((k, hvd.grouped_allreduce_async(tensors(RANK, k), op=hvd.Average, process_set=mine,
                                                   name=f"ordered.{k}")))
    if len(handles) == 4:  # four in flight
        check_average(*handles.pop(0))
for k, handle in handles:
    check_average(k, handle)
seconds = (time.perf_counter() - started) / args.ops
hvd.allreduce(torch.zeros(1))  # an unnamed op of the global set between


def mismatch(what, mine_tensors, name):
    """Rank 0 and 2 issue one op, their partners another: both members fail alike, within seconds."""
    began = time.perf_counter()
    try:
        hvd.grouped_allreduce(mine_tensors, op=hvd.Average, process_set=mine, name=name)
    except Exception as error:  # Horovod's HorovodInternalError
        message = str(error)
        check("Ordered process set" in message and str(mine.process_set_id) in message and
              "different ops" in message, f"{what}: the error does not say what happened: {message}")
        check(time.perf_counter() - began < 20, f"{what}: the error took {time.perf_counter() - began:.1f} s")
        return message
    fail(f"{what}: members that issued different ops were not told")


if args.expect_ordered:
    first = RANK % 2 == 0
    mismatch("another shape", [torch.ones(3 if first else 4)], "mismatch.shape")
    mismatch("another count", [torch.ones(3) for _ in range(2 if first else 1)], "mismatch.count")
    mismatch("another name", [torch.ones(3)], "mismatch.a" if first else "mismatch.b")
    # Failed ops back to back: a failed op's tensors are released by the executor after the op (PyTorch
    # takes the interpreter lock for it) while this thread, holding that lock, posts the next op. The
    # executor lets go of its own lock first; one that did not hung here (a few times in ten jobs).
    for k in range(args.failing_ops):
        mismatch(f"failing op {k}", [torch.ones(2 if first else 5)], f"failing.{k}")
    # Ops other than CPU allreduces are refused on an ordered set (a later allreduce could overtake them).
    try:
        hvd.allgather(torch.ones(2), process_set=mine, name="refused")
    except Exception as error:
        check("ordered process set" in str(error), f"the allgather was refused with {error}")
    else:
        fail("an allgather on an ordered set was accepted")
    # The set works again: every member ran one header check for each op, so they are still in step.
    out = hvd.allreduce(torch.tensor([float(RANK)]), op=hvd.Sum, process_set=mine, name="after")
    check(out.item() == float(RANK + partner), f"after the mismatches the set summed {out.item()}")

times = hvd.allgather(torch.tensor([seconds]), name="times").tolist()
if RANK == 0:
    print(f"SECONDS PER OP {max(times):.5f}", flush=True)
print(f"rank {RANK}: all checks passed", flush=True)
