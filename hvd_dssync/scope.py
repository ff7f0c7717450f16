"""DS-Sync inside one Horovod process set, for both adapters.

Horovod trains data-parallel inside a process set (``hvd.DistributedOptimizer(opt, process_set=ps)``):
only ``ps``'s ranks build that optimizer and step it. DS-Sync then runs among those ranks alone: its world
is the set, the schedule is indexed by position in the set (position ``i`` is global rank
``sorted(ps.ranks)[i]``), its groups are process sets of the matching global ranks, and the warm-up's
gradient allreduce and the global averages use ``ps`` itself. Ranks outside ``ps`` are untouched.

``hvd.add_process_set`` is a collective over *every* rank of the job, in the same order everywhere, and
the ranks outside ``ps`` may never build the optimizer, so the optimizer cannot always register its groups
itself. Two ways work:

- every rank of the job builds the optimizer with the same ``ps`` (Horovod's own recipe, ranks outside the
  set training alone): the ranks agree on it with one allgather over the job and register the missing
  groups together, in sorted order (:func:`acquire_registered` given ``allgather_rows``);
- the groups are registered up front on every rank: statically (``hvd_dssync.torch.init(process_sets=...)``,
  or ``hvd.init(process_sets=...)`` with :func:`process_set_groups`), or dynamically
  (:func:`add_process_set_groups` on every rank).

Where ranks pass different sets, every rank raises the same error; where the ranks outside never build the
optimizer, the agreement waits ``HVD_DSSYNC_AGREE_SECONDS`` (default 60), then the ranks that built it raise
the same error (their agreement op stays pending in Horovod, under a name of its own). For the same
reason schedules whose groups change by window, and elastic Horovod (which drops every set at a reset),
are refused inside a process set.
"""
import itertools
import os
import threading
import zlib
from typing import NamedTuple

import numpy as np

from .config import config_of
from .resolution import build_schedule
from .process_sets import _horovod_table, elastic_job, registry_for

__all__ = ["Scope", "scope_of", "process_set_groups", "add_process_set_groups", "acquire_registered"]


class Scope(NamedTuple):
    """The ranks DS-Sync runs among (global ranks, sorted) and this rank's position among them.

    Example::

        >>> scope = Scope(ranks=(1, 3), rank=1)
        >>> scope.world_size, scope.to_global((0, 1))
        (2, (1, 3))
    """
    ranks: tuple
    rank: int

    @property
    def outside(self):
        """Whether this rank is outside the set (it trains alone, as with Horovod's optimizer)."""
        return self.rank is None

    @property
    def world_size(self):
        return len(self.ranks)

    def to_global(self, group):
        """``group`` (positions in the scope) as global ranks."""
        return tuple(self.ranks[i] for i in group)

    def root(self, root_rank=None):
        """A broadcast's root: ``root_rank`` (a global rank) checked to be in the scope; by default its first.

        Example::

            >>> Scope(ranks=(1, 3), rank=0).root()
            1
        """
        root_rank = self.ranks[0] if root_rank is None else root_rank
        if root_rank not in self.ranks:
            raise ValueError(f"Arg ``root_rank`` ({root_rank}) must be a rank of the process set {list(self.ranks)}.")
        return root_rank


def _is_global(hvd, process_set):
    return process_set is hvd.global_process_set or getattr(process_set, "process_set_id", None) == 0


def scope_of(hvd, process_set):
    """The :class:`Scope` of an optimizer given ``process_set``; validated here, no communication.

    The global set gives the whole job. Another set must be registered with Horovod, outside elastic
    Horovod; each violation raises a ``ValueError`` naming ``process_set``. On a rank outside the set the
    scope's ``rank`` is ``None``: the adapters then validate as everywhere and train that rank alone.

    Example::

        scope = scope_of(hvd, ps)    # ps = hvd.ProcessSet([2, 3]) on rank 3: Scope(ranks=(2, 3), rank=1)
    """
    if _is_global(hvd, process_set):
        return Scope(tuple(range(hvd.size())), hvd.rank())
    if not hasattr(process_set, "process_set_id") or not hasattr(process_set, "ranks"):
        raise TypeError(f"Arg ``process_set`` must be a Horovod ProcessSet, got {type(process_set).__name__}.")
    if process_set.process_set_id is None or process_set.ranks is None:
        raise ValueError(f"Arg ``process_set`` ({process_set}) is not registered with Horovod: pass it to "
                         "hvd.init(process_sets=[...]) or hvd.add_process_set() on every rank first.")
    if elastic_job():
        raise ValueError("Arg ``process_set`` other than the global set is not supported under elastic Horovod, "
                         "which drops every process set when the world changes.")
    ranks = tuple(sorted(process_set.ranks))
    # A rank outside the set builds the optimizer too and trains alone, as with Horovod: position None.
    return Scope(ranks, ranks.index(hvd.rank()) if hvd.rank() in ranks else None)


def process_set_groups(ranks, num_groups=None, group_size=None, seed=0, schedule=None,
                       schedule_options=None):
    """The groups, as global ranks, that DS-Sync needs registered as process sets inside ``ranks``.

    Give the schedule arguments of the optimizer that will train inside the set. Groups of one rank do not
    communicate, and the group of the whole set is the set itself, so neither is listed. A schedule whose
    groups change by window raises a ``ValueError`` (they could not be registered without the other ranks).

    Example::

        >>> process_set_groups([4, 5, 6, 7], schedule="butterfly")
        ((4, 5), (4, 6), (5, 7), (6, 7))
    """
    ranks = tuple(sorted(ranks))
    built = build_schedule(len(ranks), schedule, num_groups, group_size, seed, None, schedule_options)
    if built.window_steps is not None:
        raise ValueError(f"schedule {built!r} changes its groups every {built.window_steps} steps "
                         "(window_steps); inside a process set the groups are registered once, by every rank of "
                         "the job, so use a schedule with one endless window (window_steps=None).")
    scope = Scope(ranks, 0)
    return tuple(sorted(scope.to_global(g) for g in built.window_groups(0) if 1 < len(g) < len(ranks)))


def add_process_set_groups(hvd, process_set, sync=None, **schedule_arguments):
    """Register the groups DS-Sync needs inside ``process_set`` (dynamic process sets; a collective).

    Call it on *every* rank of the job, in the same order, with the schedule arguments of the optimizer
    that will train inside the set (``num_groups``, ``group_size``, ``seed``, ``schedule``,
    ``schedule_options``), or its :class:`hvd_dssync.SyncConfig` as ``sync`` (then the keywords keep their
    defaults: :func:`hvd_dssync.config.config_of`); ``hvd`` is the framework's Horovod module. The sets stay
    registered for the life of the job.

    Example::

        ps = hvd.add_process_set([0, 1, 2])                   # on every rank
        add_process_set_groups(hvd, ps, group_size=2)         # on every rank
        if ps.included():
            opt = dss.DistributedOptimizer(opt, process_set=ps, group_size=2)
    """
    ranks = getattr(process_set, "ranks", None)
    if getattr(process_set, "process_set_id", None) is None or ranks is None:
        raise ValueError(f"Arg ``process_set`` ({process_set}) is not registered with Horovod: register it on "
                         "every rank first (hvd.add_process_set or hvd.init(process_sets=...)).")
    if sync is not None:
        schedule_arguments = config_of(sync, schedule_arguments).schedule_arguments()
    registry_for(hvd).acquire(process_set_groups(ranks, **schedule_arguments))


AGREE_SECONDS_ENV = "HVD_DSSYNC_AGREE_SECONDS"
DEFAULT_AGREE_SECONDS = 60.0
_agreements = itertools.count()  # names each agreement's op: one that timed out never blocks the next


def _fingerprint(*values):
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


def every_rank_agrees(allgather_rows, row, seconds):
    """Every rank's ``row`` through ``allgather_rows`` (a collective over the job), or ``None`` where it
    has not completed within ``seconds`` (some rank never called it). The wait runs in a daemon thread, so
    a collective that never completes does not hold the process.

    Example::

        >>> every_rank_agrees(lambda row: np.stack([row, row]), np.array([1, 2]), 5.0).tolist()
        [[1, 2], [1, 2]]
    """
    result = {}

    def gather():
        try:
            result["rows"] = np.asarray(allgather_rows(row))
        except BaseException as error:  # handed to the caller's thread
            result["error"] = error

    thread = threading.Thread(target=gather, name="hvd_dssync-agree", daemon=True)
    thread.start()
    thread.join(seconds)
    if "error" in result:
        raise result["error"]
    return result.get("rows")


_REGISTER_UP_FRONT = (
    "Build the optimizer with the same process set and schedule arguments on every rank of the job, or register "
    "the groups up front on every rank: hvd_dssync.torch.init(process_sets=[...], ...) or "
    "hvd.init(process_sets=...) with hvd_dssync.scope.process_set_groups(...), or "
    "add_process_set_groups(process_set, ...) after hvd.add_process_set, with the optimizer's schedule arguments.")


def _register_together(hvd, scope, missing, what, allgather_rows):
    """Register ``missing`` (global ranks) on every rank of the job where every rank is building the same
    set's optimizer. Where the ranks differ, every rank raises the same ``RuntimeError``; where some rank never
    takes part, returns why the groups could not be registered."""
    seconds = float(os.environ.get(AGREE_SECONDS_ENV, DEFAULT_AGREE_SECONDS))
    row = np.array([_fingerprint(scope.ranks), _fingerprint(tuple(missing))], dtype=np.int64)
    tag = next(_agreements)
    rows = every_rank_agrees(lambda r: allgather_rows(r, tag), row, seconds)
    if rows is None:
        return (f"not every rank of the job built it within {seconds:.0f} s ({AGREE_SECONDS_ENV}) to register "
                "them together")
    kinds = {}
    for rank, other in enumerate(map(tuple, rows.reshape(-1, 2).tolist())):
        kinds.setdefault(other, []).append(rank)
    if len(kinds) > 1:
        alike = "; ".join(f"ranks {ranks}" for ranks in kinds.values())
        raise RuntimeError(
            f"{what}: the ranks of the job built it with different process sets or schedule arguments (alike: "
            f"{alike}), so the DS-Sync groups inside its process set cannot be registered together. "
            + _REGISTER_UP_FRONT)
    registry_for(hvd).acquire(missing)  # every rank, in sorted order: a collective over the job
    return None


def acquire_registered(hvd, scope, groups, what, take=True, allgather_rows=None, ordered=True):
    """Take the process sets of ``groups`` (positions in ``scope``) from those Horovod holds, registering
    the missing ones where every rank of the job builds this optimizer.

    With ``allgather_rows(row, tag)`` (the adapter's allgather of one int64 row per rank over the whole job,
    its op named by ``tag``, as in
    Horovod's recipe where every rank builds the optimizer with the same set) the ranks agree, then
    register the missing groups together. Without it, or where the ranks do not agree, a missing group
    raises a ``RuntimeError`` naming it and the ways to register it, the same on every rank that took part.
    Returns the groups as global ranks. ``ordered``: the sets may be marked ordered (not where the optimizer
    issues other ops than allreduces on them: :meth:`hvd_dssync.process_sets.ProcessSetRegistry.acquire`).

    Example::

        acquire_registered(hvd, Scope((1, 2, 3), 0), [(0, 1), (1, 2)], "my optimizer")  # [(1, 2), (2, 3)]
    """
    wanted = sorted({scope.to_global(g) for g in groups if 1 < len(g) < scope.world_size})
    table = {tuple(sorted(r)) for r in _horovod_table().values()}
    missing = [g for g in wanted if g not in table]
    if missing:
        why = ("the ranks outside the set cannot do it from here" if allgather_rows is None
               else _register_together(hvd, scope, missing, what, allgather_rows))
        if why is not None:
            raise RuntimeError(
                f"{what}: DS-Sync inside the process set of ranks {list(scope.ranks)} needs its groups {missing} "
                f"registered as process sets by every rank of the job, and {why}. " + _REGISTER_UP_FRONT)
    if take:  # a rank outside the scope only checks, so that it raises where the set's ranks do
        registry_for(hvd).acquire(wanted, ordered=ordered)
    return wanted
