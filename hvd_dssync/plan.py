"""One training step's synchronization, decided the same way for every adapter.

:class:`SyncPlan` joins a schedule and a policy: for step ``t`` it says what to do (bulk-synchronous
gradient allreduce, group average, or global average), with which group, and which process sets must
be registered first. It also checks, with one allgather of a fingerprint done by the adapter, that all
ranks were configured alike.
"""
import hashlib
import json
from typing import NamedTuple

import numpy as np

from .policy import BSP, GLOBAL, GROUP, Policy
from .schedules import make_schedule

__all__ = ["SyncPlan", "Action", "ring_allreduce_bytes", "FINGERPRINT_FIELDS", "fingerprint",
           "check_agreement", "check_horovod_arguments", "arguments_for_world"]


class Action(NamedTuple):
    """What one step does: ``kind`` is BSP, GROUP or GLOBAL; ``group`` the ranks that average together.

    Example::

        >>> SyncPlan(rank=2, world_size=4, schedule="butterfly").action(0)
        Action(kind='group', group=(2, 3))
    """
    kind: str      # BSP, GROUP or GLOBAL
    group: tuple   # the ranks taking part (all ranks for BSP and GLOBAL)


def ring_allreduce_bytes(group_size, nbytes):
    """Bytes each rank sends in a ring allreduce of ``nbytes`` over ``group_size`` ranks.

    Example::

        >>> ring_allreduce_bytes(4, 1000), ring_allreduce_bytes(1, 1000)
        (1500, 0)
    """
    return 0 if group_size <= 1 else 2 * (group_size - 1) * nbytes // group_size


class SyncPlan:
    """The schedule and policy of one optimizer, seen from one rank.

    Args:
        rank, world_size: this rank and the number of ranks.
        schedule: a name in ``SCHEDULE_NAMES`` or a schedule object (see :func:`make_schedule`).
        num_groups, group_size, seed, topology, schedule_options: passed to :func:`make_schedule`.
        warmup_steps, global_every: the :class:`Policy`.

    Example::

        >>> plan = SyncPlan(rank=1, world_size=4, schedule="butterfly", warmup_steps=1, global_every=3)
        >>> [(a.kind, a.group) for a in map(plan.action, range(5))]  # doctest: +NORMALIZE_WHITESPACE
        [('bsp', (0, 1, 2, 3)), ('group', (1, 3)), ('group', (0, 1)), ('global', (0, 1, 2, 3)),
         ('group', (0, 1))]
        >>> plan.window_change(0)  # (groups to register, groups to release) when a window starts
        (((0, 1), (0, 2), (1, 3), (2, 3)), ())
    """

    def __init__(self, rank, world_size, schedule="shuffle", num_groups=None, group_size=None, seed=0,
                 topology=None, warmup_steps=0, global_every=0, schedule_options=None):
        self.rank = rank
        self.world_size = world_size
        self.world = tuple(range(world_size))
        self.policy = Policy(warmup_steps=warmup_steps, global_every=global_every)
        if world_size == 1:
            num_groups, group_size = (1, None) if schedule == "shuffle" else (None, group_size)
        self.schedule = make_schedule(schedule, world_size, num_groups=num_groups, group_size=group_size,
                                      seed=seed, topology=topology, **(schedule_options or {}))
        self._window = None

    def action(self, step):
        kind = self.policy.action(step)
        if kind == GROUP:
            return Action(GROUP, self.schedule.group_of(self.rank, step))
        return Action(kind, self.world)

    def window_change(self, step):
        """``(acquire, release)`` group lists when ``step`` enters a new window, else ``None``.

        Call once per step on every rank, before the step's communication; it remembers the window.
        """
        window = self.schedule.window_of(step)
        if window == self._window:
            return None
        acquire = self.schedule.window_groups(window)
        release = () if self._window is None else self.schedule.window_groups(self._window)
        self._window = window
        return acquire, release

    def forget_window(self):
        """The groups of the window in use, now released by the caller (e.g. at shutdown)."""
        groups = () if self._window is None else self.schedule.window_groups(self._window)
        self._window = None
        return groups

    def config(self):
        return {"schedule": self.schedule.config(), "policy": self.policy.config()}


def arguments_for_world(arguments, world_size):
    """The plan's arguments for a world of ``world_size`` ranks, after an elastic change of world.

    ``arguments`` are the keyword arguments the optimizer built its plan with (those of
    :class:`SyncPlan` but ``rank`` and ``world_size``); the same arguments are returned, with
    ``num_groups`` and ``group_size`` capped at the new world size (a world that shrank below the requested
    groups keeps as many as it can). A schedule object or a topology was built for a fixed set of ranks:
    it raises a ``RuntimeError`` that names it. No communication; both adapters use it.

    Example::

        >>> arguments_for_world({"schedule": "shuffle", "num_groups": 3, "group_size": None}, 2)
        {'schedule': 'shuffle', 'num_groups': 2, 'group_size': None}
        >>> arguments_for_world({"schedule": "topology", "topology": [[0, 1], [2]]}, 2)
        Traceback (most recent call last):
        ...
        RuntimeError: hvd_dssync: the world changed to 2 ranks, but the schedule 'topology' was built ...
    """
    schedule = arguments.get("schedule", "shuffle")
    if not isinstance(schedule, str) or schedule == "topology" or arguments.get("topology") is not None:
        raise RuntimeError(f"hvd_dssync: the world changed to {world_size} ranks, but the schedule {schedule!r} "
                           "was built for a fixed set of ranks; elastic training needs schedule='shuffle' or "
                           "'butterfly'.")
    arguments = dict(arguments)
    for key in ("num_groups", "group_size"):
        if arguments.get(key) is not None:
            arguments[key] = min(arguments[key], world_size)
    return arguments


def check_horovod_arguments(hvd, op, gradient_predivide_factor, backward_passes_per_step, process_set):
    """Validate the arguments both adapters take from Horovod's ``DistributedOptimizer``.

    ``hvd`` is the framework's Horovod module (for its op constants and global process set). Raises
    before any communication, with a message naming the argument and the rule. Returns the ranks DS-Sync
    runs among, a :class:`hvd_dssync.scope.Scope`: the whole job, or ``process_set``'s ranks.

    Example::

        scope = check_horovod_arguments(hvd, hvd.Average, 1.0, 1, hvd.global_process_set)  # the whole job
    """
    if op == hvd.Adasum:
        raise ValueError("Arg ``op=hvd.Adasum`` has no meaning under DS-Sync, which averages models "
                         "within groups; use op=hvd.Average.")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"Arg ``op`` must be hvd.Average or hvd.Sum (for the warm-up's gradients), got {op!r}.")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("Arg ``gradient_predivide_factor`` is only supported with op=hvd.Average.")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"Arg ``backward_passes_per_step`` must be a positive integer, got "
                         f"{backward_passes_per_step!r}.")
    from .scope import scope_of  # scope builds plans: imported here, not at the top

    return scope_of(hvd, process_set)


FINGERPRINT_FIELDS = ("world size", "schedule", "policy", "parameters", "options")


def _digest(value):
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "little")


def fingerprint(fields):
    """An int64 vector, one hash per name in ``FINGERPRINT_FIELDS``, for an allgather across ranks.

    Example::

        >>> fingerprint({"world size": 4, "schedule": {"name": "shuffle"}}).shape
        (5,)
    """
    unknown = set(fields) - set(FINGERPRINT_FIELDS)
    if unknown:
        raise KeyError(f"unknown fingerprint fields {sorted(unknown)}")
    return np.array([_digest(fields.get(name)) for name in FINGERPRINT_FIELDS], dtype=np.int64)


def check_agreement(gathered, what="hvd_dssync"):
    """Raise the same ``ValueError`` on every rank if the gathered fingerprints differ.

    ``gathered`` is the ``(world_size, len(FINGERPRINT_FIELDS))`` array every rank got from the
    allgather; the message names each differing field and the ranks that differ from rank 0.

    Example::

        >>> a, b = fingerprint({"schedule": "shuffle"}), fingerprint({"schedule": "butterfly"})
        >>> check_agreement([a, a, b])
        Traceback (most recent call last):
        ...
        ValueError: hvd_dssync: ranks disagree on the configuration: schedule (ranks [2] differ from rank 0). ...
    """
    gathered = np.asarray(gathered).reshape(-1, len(FINGERPRINT_FIELDS))
    problems = []
    for i, name in enumerate(FINGERPRINT_FIELDS):
        differ = [int(r) for r in np.nonzero(gathered[:, i] != gathered[0, i])[0]]
        if differ:
            problems.append(f"{name} (ranks {differ} differ from rank 0)")
    if problems:
        raise ValueError(f"{what}: ranks disagree on the configuration: {'; '.join(problems)}. Every rank "
                         "must build the optimizer with the same arguments and the same model.")


__all__ += ["BSP", "GLOBAL", "GROUP"]
