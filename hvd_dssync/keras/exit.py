"""The exit drain: every rank finishes its last group average before any rank shuts Horovod down.

Under DS-Sync the groups of the last step finish at different times; a rank that exits and shuts Horovod
down while another group still averages makes that group's step fail. So a script that ends without a
global collective gets one at exit (:func:`hvd_dssync.watchdog.drain_at_exit`), as in the PyTorch adapter.
"""
import threading
import weakref

import horovod.tensorflow as hvd
import tensorflow as tf

from ..watchdog import drain_once_at_exit, exit_timeout

__all__ = ["watch_until_exit"]

# Every StepSync of this process, for the exit-time drain.
_live = weakref.WeakSet()


def watch_until_exit(sync):
    """Track ``sync`` (a :class:`hvd_dssync.keras.sync.StepSync`); once per process, arrange a drain before
    Horovod's own exit-time shutdown.

    Registered after ``hvd.init()`` (which registers Horovod's shutdown), so it runs first.

    Example::

        watch_until_exit(self)      # at the end of the StepSync's construction
    """
    _live.add(sync)
    drain_once_at_exit(_drain_before_shutdown)


def _drain_before_shutdown():
    """An allreduce over each DS-Sync process set, waited for at most ``HVD_DSSYNC_EXIT_TIMEOUT`` seconds
    (default 30), so that a rank whose peers are stuck or gone still exits. Skipped after an uncaught
    exception (:func:`hvd_dssync.watchdog.drain_at_exit`).
    """
    if not hvd.is_initialized():
        return
    process_sets = {id(s.process_set): s.process_set for s in list(_live)}

    def drain():
        try:
            for sync in list(_live):  # the averages still in flight (overlap=True) first
                sync.drain()
            for process_set in process_sets.values():
                hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name=f"DSSync_exit_{process_set.process_set_id}",
                              process_set=process_set)
        except Exception:  # Horovod already shut down by a failing peer: nothing left to drain
            pass

    # Horovod's eager op cannot be given a deadline; a daemon thread waiting for it can be left behind.
    waiter = threading.Thread(target=drain, name="hvd_dssync-exit-drain", daemon=True)
    waiter.start()
    waiter.join(exit_timeout())
