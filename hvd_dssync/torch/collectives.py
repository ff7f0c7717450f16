"""Horovod's blocking collectives, waited for without keeping a core busy.

``hvd.synchronize`` as released waits in a loop that only yields the core (``std::this_thread::yield``), so a
rank waiting for its group's average keeps a core busy until the average lands. Where ranks share cores (more
ranks than cores, or ranks beside data loaders), that busy wait takes the core from the ranks still computing
and from the Horovod threads that move the bytes. On the Horovod that scripts/setup.sh builds (patch level 10,
scripts/patches/waiting-handles.patch) ``hvd.synchronize`` blocks until the op's callback wakes it, as
``torch.distributed``'s ``Work.wait`` does, and :func:`wait` calls it. On any other Horovod a rank sleeps
between polls instead, a little longer each time up to :data:`LONGEST_SLEEP`, which bounds what a finished op
waits to be noticed. docs/build.md has what the blocking wait measured. :func:`warm_window_sets` takes Horovod's
one-off set-up of each of the first window's process sets before the first average.
"""
import time

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from .. import build

__all__ = ["wait", "grouped_allreduce", "grouped_allreduce_", "allreduce_", "allgather", "broadcast",
           "warm_window_sets", "LONGEST_SLEEP", "SHUT_DOWN"]

SHUT_DOWN = ("hvd_dssync: Horovod is shut down, so this step cannot average: another rank failed or exited early "
             "(its output says why), or hvd.shutdown() was called.")

FIRST_SLEEP = 5e-5
LONGEST_SLEEP = 1e-3
# hvd.synchronize blocks until woken (waiting handles, patch level 10) rather than spinning.
_BLOCKING_SYNCHRONIZE = build.patch_level() >= 10


def wait(handle):
    """``hvd.synchronize(handle)`` without spinning: blocked until woken on the project's build, sleeping
    between polls on any other Horovod.

    Example::

        handle = hvd.allreduce_async_(tensor, name="x", op=hvd.Average)
        wait(handle)
    """
    pause = FIRST_SLEEP
    try:
        while not _BLOCKING_SYNCHRONIZE and not hvd.poll(handle):
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_SLEEP)
        return hvd.synchronize(handle)
    except HorovodInternalError as e:
        # Horovod shut down while this op was in flight (a peer exited or failed): the same clear error
        # the next step would raise, rather than Horovod's own.
        if "shut down" in str(e):
            raise RuntimeError(SHUT_DOWN) from e
        raise


def grouped_allreduce_(tensors, **kwargs):
    """``hvd.grouped_allreduce_`` (in place) with :func:`wait`.

    Example::

        grouped_allreduce_([weight, bias], name="average", op=hvd.Average, process_set=group)
    """
    return wait(hvd.grouped_allreduce_async_(tensors, **kwargs))


def grouped_allreduce(tensors, **kwargs):
    """``hvd.grouped_allreduce`` (new outputs) with :func:`wait`.

    Example::

        averaged = grouped_allreduce([weight, bias], name="average", op=hvd.Average, process_set=group)
    """
    return wait(hvd.grouped_allreduce_async(tensors, **kwargs))


def allreduce_(tensor, **kwargs):
    """``hvd.allreduce_`` (in place) with :func:`wait`.

    Example::

        allreduce_(torch.zeros(1), name="alone", op=hvd.Sum, process_set=group)
    """
    return wait(hvd.allreduce_async_(tensor, **kwargs))


def allgather(tensor, **kwargs):
    """``hvd.allgather`` with :func:`wait`.

    Example::

        rows = allgather(ids, name="rows", process_set=group)
    """
    return wait(hvd.allgather_async(tensor, **kwargs))


def broadcast(tensor, root_rank, **kwargs):
    """``hvd.broadcast`` (a new output) with :func:`wait`.

    Example::

        step = broadcast(torch.tensor([7.0]), 0, name="step", process_set=group)
    """
    return wait(hvd.broadcast_async(tensor, root_rank, **kwargs))


def warm_window_sets(world, registry, name):
    """One tiny allreduce on each process set this rank belongs to among the first window's groups and the later
    windows' groups already registered (statically, by :func:`hvd_dssync.init`; ``registry``: the
    :class:`hvd_dssync.process_sets.ProcessSetRegistry`), named after ``name``, so that Horovod's one-off set-up of
    a set's first collective is taken here and not by the first average in it. Only where every rank belongs to as
    many of the sets: every Horovod op advances the counter that names a script's unnamed ops."""
    if world.in_process_set:
        return
    schedule, scope = world.plan.schedule, world.scope
    size = scope.world_size
    groups = sorted(set(schedule.window_groups(0)) | set(schedule.every_group() or ()))
    sets = registry.registered(scope.to_global(g) for g in groups if 1 < len(g) < size)
    groups = [g for g in groups if scope.to_global(g) in sets]
    counts = {sum(position in g for g in groups) for position in range(size)}
    if not groups or len(counts) != 1:
        return
    handles = [hvd.allreduce_async_(torch.zeros(1), name=f"{name}.warm.{k}", op=hvd.Sum,
                                    process_set=sets[scope.to_global(g)])
               for k, g in enumerate(groups) if scope.rank in g]
    for handle in handles:
        wait(handle)
