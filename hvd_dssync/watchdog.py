"""A bound on how long one DS-Sync average may wait for its group, for both adapters.

A rank that dies breaks its connections, and Horovod fails the others. A rank that is alive but stops
calling Horovod (stuck in a data loader, a deadlock, a debugger) breaks nothing: its background thread
keeps negotiating, and the members of its group wait for it forever. Horovod's stall inspector does not
end such a job either. So each adapter arms the process's watchdog while one of its averages is in
flight; if the average has not completed after ``HVD_DSSYNC_TIMEOUT`` seconds (default 1800, as
``torch.distributed``'s default timeout; 0 waits forever), the watchdog says which group and step it was
waiting for and shuts Horovod down. Horovod's controller spreads the shutdown to every rank in its next
cycle, so every rank's pending and next op fails instead of hanging, and the launcher ends the job.

Framework-free: the adapter hands over its shutdown function.
"""
import atexit
import os
import sys
import threading
import time

__all__ = ["Watchdog", "TIMEOUT_ENV", "timeout_from_env", "describe_wait", "EXIT_TIMEOUT_ENV", "exit_timeout",
           "drain_at_exit", "drain_once_at_exit"]

TIMEOUT_ENV = "HVD_DSSYNC_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0


def timeout_from_env():
    """``HVD_DSSYNC_TIMEOUT`` in seconds (``None``: wait forever); a clear error if it is not a number.

    Example::

        os.environ["HVD_DSSYNC_TIMEOUT"] = "600"   # on every rank, before the optimizer is built
        timeout_from_env()                          # 600.0
    """
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(text) if text.strip() else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds (0: wait forever), got {text!r}.") from None
    if seconds < 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds >= 0 (0: wait forever), got {text!r}.")
    return seconds or None


def describe_wait(rank, group, step, kind):
    """What an armed wait says when it expires: who waits for whom, at which step, for which average.

    Example::

        describe_wait(0, (0, 1, 3), 12, "group")  # 'rank 0 waits for ranks [1, 3] to average at step 12 (group)'
    """
    peers = [r for r in group if r != rank]
    return f"rank {rank} waits for ranks {peers} to average at step {step} ({kind})"


class Watchdog:
    """Shuts Horovod down when an armed wait outlives ``timeout`` seconds.

    One daemon thread per watchdog, started on the first :meth:`arm`, sleeping until the earliest deadline.
    ``shutdown`` is called from that thread, once; ``expired`` then holds the message it printed, for the
    adapter to raise when its op fails.

    Args:
        timeout: seconds an armed wait may last; ``None`` never expires.
        shutdown: called when a wait expires (the framework's ``hvd.shutdown``).
        stream: where the message goes (standard error by default).

    Example::

        watchdog = Watchdog(timeout=60, shutdown=hvd.shutdown)
        with watchdog.watching("rank 0 waits for group (0, 1) at step 12"):
            hvd.grouped_allreduce_(tensors, process_set=group_set)
    """

    def __init__(self, timeout, shutdown, stream=None):
        self.timeout = timeout
        self._shutdown = shutdown
        self._stream = stream
        self._armed = {}
        self._tokens = iter(range(sys.maxsize))
        self._condition = threading.Condition()
        self._thread = None
        self._shut_down = threading.Event()
        self.expired = None
        # Horovod's own exit-time shutdown must not join its background thread while this one's shutdown
        # is joining it too (two joins of one thread hang): at exit, let ours finish first.
        atexit.register(self.wait_for_shutdown)

    def arm(self, what):
        """Start bounding a wait described by ``what`` (who waits for whom); returns a token to disarm."""
        if self.timeout is None:
            return None
        with self._condition:
            token = next(self._tokens)
            self._armed[token] = (time.monotonic() + self.timeout, what)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="hvd_dssync-watchdog", daemon=True)
                self._thread.start()
        return token

    def disarm(self, token):
        """The wait of ``token`` ended (completed or failed)."""
        if token is None:
            return
        with self._condition:
            self._armed.pop(token, None)

    def wait_for_shutdown(self, timeout=60.0):
        """After an expiry, wait (at most ``timeout`` seconds) until the watchdog's shutdown returned."""
        if self.expired is not None:
            self._shut_down.wait(timeout)

    def watching(self, what):
        """A context manager arming the watchdog for its body."""
        return _Watching(self, what)

    def _watch(self):
        with self._condition:
            while self.expired is None:
                if not self._armed:
                    # A wait armed from now on expires after this one ends: no need to wake the thread per
                    # arm, which would cost a context switch per training step.
                    self._condition.wait(self.timeout)
                    continue
                deadline, what = min(self._armed.values(), key=lambda item: item[0])
                left = deadline - time.monotonic()
                if left > 0:
                    self._condition.wait(left)
                    continue
                self.expired = (f"hvd_dssync: {what}, and it has not completed after {self.timeout:g} s "
                                f"({TIMEOUT_ENV}): a peer is alive but no longer calling Horovod (stuck or far "
                                "behind). Shutting Horovod down so that every rank stops; set "
                                f"{TIMEOUT_ENV} higher to wait longer, 0 to wait forever.")
        print(self.expired, file=self._stream or sys.stderr, flush=True)
        try:
            self._shutdown()
        except Exception as e:  # already shut down by a failing peer: nothing left to stop
            print(f"hvd_dssync: watchdog could not shut Horovod down: {e}", file=self._stream or sys.stderr,
                  flush=True)
        finally:
            self._shut_down.set()


class _Watching:
    def __init__(self, watchdog, what):
        self._watchdog, self._what, self._token = watchdog, what, None

    def __enter__(self):
        self._token = self._watchdog.arm(self._what)
        return self._watchdog

    def __exit__(self, *exc_info):
        self._watchdog.disarm(self._token)
        return False


_process = {}


def process_watchdog(shutdown):
    """The process's one watchdog (both adapters share it), its timeout read from the environment once."""
    if "watchdog" not in _process:
        _process["watchdog"] = Watchdog(timeout_from_env(), shutdown)
    return _process["watchdog"]


# The exit-time drain of both adapters: how long it waits for the other ranks (default 30 s).
EXIT_TIMEOUT_ENV = "HVD_DSSYNC_EXIT_TIMEOUT"
_uncaught = {"hooked": False, "seen": False}


def exit_timeout():
    """``HVD_DSSYNC_EXIT_TIMEOUT`` in seconds: how long an exit-time drain waits for the other ranks.

    Example::

        os.environ["HVD_DSSYNC_EXIT_TIMEOUT"] = "5"   # on every rank, before the script ends
        exit_timeout()                                 # 5.0 (unset: 30.0)
    """
    return float(os.environ.get(EXIT_TIMEOUT_ENV, "30"))


def drain_once_at_exit(drain):
    """:func:`drain_at_exit`, once per process for this ``drain``: ``True`` the first time (the adapters call
    it whenever an optimizer is built).

    Example::

        if drain_once_at_exit(_drain_before_shutdown):
            ...   # what else happens once per process
    """
    if drain in _drains_registered:
        return False
    _drains_registered.add(drain)
    drain_at_exit(drain)
    return True


_drains_registered = set()


def drain_at_exit(drain):
    """Run ``drain()`` when the interpreter exits, unless the script ended with an uncaught exception.

    Under DS-Sync the groups of the last step finish at different times; a rank that exits and shuts
    Horovod down while another group still averages makes that group's step fail, so each adapter drains
    with one collective first. Register after ``hvd.init()``, which registers Horovod's own shutdown:
    exit hooks run last-registered first. After an uncaught exception the drain is skipped, so that
    Horovod's shutdown reaches the other ranks at once.

    Example::

        hvd.init()
        drain_at_exit(lambda: hvd.allreduce(torch.zeros(1), name="exit", op=hvd.Sum))
    """
    if not _uncaught["hooked"]:
        _uncaught["hooked"] = True
        previous_hook = sys.excepthook

        def note_uncaught(*exc_info):
            _uncaught["seen"] = True
            previous_hook(*exc_info)

        sys.excepthook = note_uncaught

    def run():
        if not _uncaught["seen"]:
            drain()

    atexit.register(run)
