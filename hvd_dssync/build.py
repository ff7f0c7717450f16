"""Which Horovod build this process runs on: Horovod as released, or the project's build and its patch level.

scripts/setup.sh builds Horovod 0.28.1 with the project's patches (docs/build.md); each level leaves a string
in Horovod's library that this module reads, without loading it. The adapters call :func:`warn_once` on rank 0
so that a job on another build says once what it lacks and what that costs.
"""
import functools
import glob
import importlib.util
import mmap
import os
import warnings

__all__ = ["PATCH_LEVEL", "patch_level", "missing_patches", "supported", "warn_once"]

PATCH_LEVEL = 11  # what scripts/setup.sh builds (its HOROVOD_PATCH)
DOCS = "docs/build.md in hvd_dssync's sources"

# (level, the string that level leaves in the library), newest first.
_MARKERS = (*((level, f"hvd_dssync-build-patch-level-{level}".encode()) for level in (11, 10, 9, 8, 7)),
            (6, b"HOROVOD_DYNAMIC_PROCESS_SETS_CHECK_EVERY"))

# What each level adds (its name, for ``python -m hvd_dssync info``) and what a job without it pays
# (docs/build.md has the figures).
_LEVELS = {
    6: ("waits that sleep instead of spinning and process sets' Gloo contexts on HOROVOD_GLOO_IFACE",
        "without them, with more ranks than cores, collectives that take milliseconds take seconds and Gloo jobs "
        "can time out, and process sets on several hosts can hang in their rendezvous"),
    7: ("concurrent process sets", "without it every rank's Horovod loop runs the groups' averages one at a time, "
        "so a group waits for the others' averages and DS-Sync's groups do not run side by side"),
    8: ("MPI waits that sleep", "without it, under mpirun with more ranks than cores, Horovod's negotiation and "
        "the groups' averages keep every waiting rank's core busy, and single steps take seconds"),
    9: ("ordered process sets", "without it every group average waits for Horovod's loop to negotiate it with "
        "the group's members first, a cycle or more, and longer beside other sets' ops"),
    10: ("waiting handles", "without it hvd.synchronize polls (sleeping up to 1 ms between polls here), so every "
         "average returns up to a sleep after it completed, and an ordered set's header check takes 2 (n - 1) "
         "exchanges in turn instead of one"),
    11: ("an idle loop that sleeps", "without it Horovod's loop runs a collective over all ranks every millisecond "
         "between DS-Sync's averages, and on a host whose cores the ranks share each local step is 5-10 ms longer"),
}


def _library():
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for pattern in ("torch/mpi_lib_v2*.so", "tensorflow/mpi_lib*.so"):
            found = sorted(glob.glob(os.path.join(folder, pattern)))
            if found:
                return found[0]
    return None


@functools.lru_cache(maxsize=None)
def patch_level(library=None):
    """The patch level of the installed Horovod's library (or of ``library``): 0 for Horovod as released (or
    no library found), else the newest level whose string is in it.

    Example::

        patch_level()   # 10 after scripts/setup.sh
    """
    library = library or _library()
    if library is None:
        return 0
    # Mapped, not read: the library is tens of MB, and every rank asks (hvd_dssync.torch.collectives).
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return next((level for level, marker in _MARKERS if data.find(marker) >= 0), 0)


def supported(level):
    """The names of what the levels up to ``level`` add, newest first.

    Example::

        >>> supported(8)[:2]
        ['MPI waits that sleep', 'concurrent process sets']
    """
    return [_LEVELS[k][0] for k in sorted(_LEVELS, reverse=True) if k <= level]


def missing_patches(level):
    """What the levels above ``level`` add, one sentence each (empty at :data:`PATCH_LEVEL`).

    Example::

        >>> missing_patches(PATCH_LEVEL)
        []
        >>> len(missing_patches(6))
        5
    """
    return [": ".join(_LEVELS[k]) for k in sorted(_LEVELS) if k > level]


_warned = []


def warn_once(rank):
    """On rank 0, once per process: a warning naming what this Horovod build lacks, if anything."""
    if rank != 0 or _warned:
        return
    _warned.append(True)
    level = patch_level()
    missing = missing_patches(level)
    if missing:
        build = "Horovod as released" if level == 0 else f"the project's build at patch level {level}"
        warnings.warn(f"hvd_dssync runs on {build}, not patch level {PATCH_LEVEL} (scripts/setup.sh); it lacks "
                      + "; and ".join(missing) + f". See {DOCS}.", RuntimeWarning, stacklevel=3)
