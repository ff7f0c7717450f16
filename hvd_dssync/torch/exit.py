"""The exit drain: every rank finishes its last group average before any rank shuts Horovod down.

Under DS-Sync the groups of the last step finish at different times; a rank that exits and shuts Horovod
down while another group still averages makes that group's op fail. So a script that ends without a
global collective gets one at exit (:func:`hvd_dssync.watchdog.drain_at_exit`).
"""
import time
import warnings

import horovod.torch as hvd
import torch

from ..topology import loopback_hostname_warning
from ..watchdog import drain_once_at_exit, exit_timeout
from .live import live_optimizers

__all__ = ["watch_until_exit"]

def watch_until_exit(optimizer):
    """Track ``optimizer``; once per process, arrange a drain before Horovod's own exit-time shutdown.

    Registered after ``hvd.init()`` (which registers Horovod's shutdown), so it runs first.

    Example::

        watch_until_exit(self)      # at the end of the optimizer's construction
    """
    live_optimizers.add(optimizer)
    if drain_once_at_exit(_drain_before_shutdown):
        message = loopback_hostname_warning(hvd.cross_size())
        if message:
            warnings.warn(message)


def _drain_before_shutdown():
    """Fold in the averages in flight, then one named allreduce, waited for at most ``HVD_DSSYNC_EXIT_TIMEOUT``
    seconds (default 30) so that a rank whose peers are stuck or gone still exits."""
    if not hvd.is_initialized():
        return
    try:
        optimizers = list(live_optimizers)
        for optimizer in optimizers:
            optimizer.finish_pending()
        handles = [hvd.allreduce_async(torch.zeros(1), name="dssync.exit", op=hvd.Sum, process_set=process_set)
                   for process_set in _exit_process_sets(optimizers)]
        deadline = time.monotonic() + exit_timeout()
        while not all(hvd.poll(h) for h in handles) and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # Horovod already shut down by a failing peer: nothing left to drain
        pass


def _exit_process_sets(optimizers):
    """Where the exit drain meets: all ranks, unless every optimizer trains inside a process set.

    Ranks outside a set may never build a DS-Sync optimizer, so they would not join a global drain; every
    member of a set has the same optimizers, so one drain per set, in id order, is met by all of them.
    """
    sets = {o.process_set.process_set_id: o.process_set for o in optimizers}
    if not sets or 0 in sets:
        return [hvd.global_process_set]
    return [sets[i] for i in sorted(sets)]
