"""Horovod's background loop while DS-Sync trains: an idle loop that sleeps (the build's patch level 11).

Every cycle of Horovod's loop (``HOROVOD_CYCLE_TIME``, 1 ms) starts with a collective over all ranks, then one in
each of the rank's process sets, whether or not an op waits. DS-Sync issues an op every few steps (its groups'
ordered sets skip the loop), so between its averages the loop runs empty collectives, on every rank, a thousand
times a second: on a host whose cores the ranks share, CPU taken from the steps (the bench's ``accelerator``
scenario on 4 ranks of 2 cores: local steps 5-10 ms longer than those of ranks that never communicate,
docs/build.md). Both adapters' optimizers set a longer idle cycle when they are built
(:func:`set_idle_cycle`): while a rank has no op in the loop, its loop waits :data:`IDLE_CYCLE_MS` from the last
cycle's start, and is woken at once when an op is enqueued on it, so an op is not delayed. ``HVD_DSSYNC_IDLE_CYCLE_MS``
(on every rank alike) sets it; ``0`` keeps Horovod's pacing. On a build without the patch, nothing changes.

Framework-free: it calls Horovod's common library, which both adapters load.
"""
import ctypes
import math
import os

from .process_sets import horovod_library

__all__ = ["IDLE_CYCLE_ENV", "IDLE_CYCLE_MS", "idle_cycle_ms", "set_idle_cycle", "loop_cycles"]

IDLE_CYCLE_ENV = "HVD_DSSYNC_IDLE_CYCLE_MS"
# The idle cycle's length: the accelerator scenario's local steps were those of ranks that never communicate with
# Horovod's every cycle at 10 ms (docs/build.md); an op wakes the loop, so it does not wait for it.
IDLE_CYCLE_MS = 10.0


def idle_cycle_ms(environ=None):
    """The idle cycle the optimizers set, in milliseconds: :data:`IDLE_CYCLE_ENV`, a number of 0 or more (0: Horovod's
    pacing), else :data:`IDLE_CYCLE_MS`. A clear error names a bad value.

    Example::

        >>> idle_cycle_ms({}), idle_cycle_ms({"HVD_DSSYNC_IDLE_CYCLE_MS": "0"}), idle_cycle_ms({IDLE_CYCLE_ENV: "25"})
        (10.0, 0.0, 25.0)
        >>> idle_cycle_ms({IDLE_CYCLE_ENV: "soon"})
        Traceback (most recent call last):
        ...
        ValueError: HVD_DSSYNC_IDLE_CYCLE_MS must be milliseconds, 0 or more (0: Horovod's own cycle), not 'soon'
    """
    environ = os.environ if environ is None else environ
    value = environ.get(IDLE_CYCLE_ENV, "").strip()
    if not value:
        return IDLE_CYCLE_MS
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms >= 0):
        raise ValueError(f"{IDLE_CYCLE_ENV} must be milliseconds, 0 or more (0: Horovod's own cycle), not {value!r}")
    return ms


def set_idle_cycle(ms=None):
    """Set this rank's idle cycle to ``ms`` milliseconds (None: :func:`idle_cycle_ms`; 0: Horovod's pacing). Returns
    whether the build could (patch level 11; after ``hvd.init``)."""
    ms = idle_cycle_ms() if ms is None else float(ms)
    setter = getattr(horovod_library(), "horovod_set_idle_cycle_time_ms", None)
    if setter is None:
        return False
    setter.argtypes, setter.restype = [ctypes.c_double], ctypes.c_int
    return setter(ms) == 1


def loop_cycles():
    """How many cycles Horovod's loop has run on this rank (None: a build without patch level 11)."""
    counter = getattr(horovod_library(), "horovod_loop_cycles", None)
    if counter is None:
        return None
    counter.argtypes, counter.restype = [], ctypes.c_longlong
    return int(counter())
