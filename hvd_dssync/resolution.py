"""How DS-Sync's schedule arguments resolve into a schedule, the same way for every caller (the plan,
:class:`hvd_dssync.config.SyncConfig`, the adapters' ``init``, the process-set helpers).

:func:`resolve_schedule` (the default schedule), :func:`default_group_size`, :func:`build_schedule`,
:func:`arguments_for_world` and :func:`refuse_topology_in_process_set`: every one a pure function of its
arguments (and ``HVD_DSSYNC_TOPOLOGY``), so every rank decides alike, without communicating.
:class:`hvd_dssync.config.SyncConfig` uses them.
"""
import math
import os

import numpy as np

from .schedules import SCHEDULE_NAMES, Schedule, make_schedule, refuse_sizes_with_topology
from .schedules.base import _check_int
from .sensing import AUTO
from .topology import ENV_VAR as TOPOLOGY_ENV, Topology

__all__ = ["resolve_schedule", "default_group_size", "build_schedule", "arguments_for_world",
           "refuse_topology_in_process_set"]


def default_group_size(world_size):
    """The group size of the default schedule (random groups, "shuffle") for ``world_size`` ranks.

    - up to 3 ranks: one group of all ranks (smaller groups would leave a rank alone every other step);
    - 4 to 7 ranks: two groups (pairs for 4 ranks, as the DS-Sync authors' 4-worker code);
    - 8 ranks and more: groups of 4. Per step each rank sends ``2 (g - 1) / g`` models in its group's ring
      (1.5 models for ``g = 4``, 1 for pairs) while a random group of ``g`` shrinks the distance from
      consensus about ``g``-fold, so groups of 4 mix faster per byte sent than pairs, and each rank
      still belongs to only two process sets (the schedule's two partitions), which Horovod negotiates on
      every cycle. Larger groups approach bulk-synchronous averaging and its wait for the slowest member.

    Example::

        >>> [default_group_size(n) for n in (1, 2, 3, 4, 5, 7, 8, 64)]
        [1, 2, 3, 2, 3, 4, 4, 4]
    """
    if world_size <= 3:
        return world_size
    if world_size <= 7:
        return math.ceil(world_size / 2)
    return 4


def resolve_schedule(schedule, num_groups, group_size, topology):
    """The schedule an optimizer built without DS-Sync arguments uses: ``(schedule, num_groups, group_size)``.

    ``schedule=None`` (the adapters' default) is "topology" when the racks are known (``topology=`` or the
    ``HVD_DSSYNC_TOPOLOGY`` variable), else "shuffle". A "shuffle" without ``num_groups`` or ``group_size``
    takes :func:`default_group_size` when the world size is known (it is left ``None`` here and filled by
    :class:`hvd_dssync.plan.SyncPlan`). ``num_groups`` or ``group_size`` with a topology-aware schedule
    (asked for, or the default where the racks are known) raises a ``ValueError`` naming the argument: that
    schedule's groups are the racks and their bridges. A pure function of its arguments and the
    environment: every rank decides alike. No communication.

    Example::

        >>> resolve_schedule(None, None, None, None)
        ('shuffle', None, None)
        >>> resolve_schedule(None, None, None, [[0, 1], [2, 3]])[0]
        'topology'
        >>> resolve_schedule(None, 3, None, [[0, 1], [2, 3]])
        Traceback (most recent call last):
        ...
        ValueError: Arg ``num_groups`` does not apply to the default schedule, topology-aware since ``topology`` ...
    """
    why = "schedule='topology'"
    if schedule is None:
        if topology is not None:
            schedule, why = "topology", "the default schedule, topology-aware since ``topology`` is given,"
        elif os.environ.get(TOPOLOGY_ENV):
            schedule, why = "topology", f"the default schedule, topology-aware since {TOPOLOGY_ENV} is set,"
        else:
            schedule = "shuffle"
    if schedule == "topology":
        refuse_sizes_with_topology(num_groups, group_size, why)
    return schedule, num_groups, group_size


def build_schedule(world_size, schedule="shuffle", num_groups=None, group_size=None, seed=0, topology=None,
                   schedule_options=None):
    """The schedule of a plan of ``world_size`` ranks: :func:`resolve_schedule`, then the sizes a "shuffle"
    given none takes (:func:`default_group_size`; one group for one rank), then
    :func:`hvd_dssync.schedules.make_schedule`. ``topology`` racks given as lists of ranks are parsed
    (:meth:`hvd_dssync.topology.Topology.parse`). No communication.

    Example::

        >>> build_schedule(4)
        Shuffle(world_size=4, num_groups=2, seed=0, partitions_per_window=2, window_steps=None)
        >>> build_schedule(4, None, topology=[[0, 1], [2, 3]]).config()["racks"]
        [[0, 1], [2, 3]]
    """
    schedule, num_groups, group_size = resolve_schedule(schedule, num_groups, group_size, topology)
    if world_size == 1:
        num_groups, group_size = (1, None) if schedule == "shuffle" else (None, group_size)
    elif schedule == "shuffle" and num_groups is None and group_size is None:
        group_size = default_group_size(world_size)
    if topology is not None and not isinstance(topology, Topology):
        topology = Topology.parse(topology)
    return make_schedule(schedule, world_size, num_groups=num_groups, group_size=group_size, seed=seed,
                         topology=topology, **(schedule_options or {}))


def arguments_for_world(arguments, world_size):
    """The plan's arguments for a world of ``world_size`` ranks, after an elastic change of world.

    ``arguments`` are the keyword arguments the optimizer built its plan with (those of
    :class:`hvd_dssync.plan.SyncPlan` but ``rank`` and ``world_size``); the same arguments are returned,
    with ``num_groups`` and ``group_size`` capped at the new world size (a world that shrank below the
    requested groups keeps as many as it can). A schedule object or a topology was built for a fixed set of
    ranks: it raises a ``RuntimeError`` that names it. No communication; both adapters use it.

    Example::

        >>> arguments_for_world({"schedule": "shuffle", "num_groups": 3, "group_size": None}, 2)
        {'schedule': 'shuffle', 'num_groups': 2, 'group_size': None}
        >>> arguments_for_world({"schedule": "topology", "topology": [[0, 1], [2]]}, 2)
        Traceback (most recent call last):
        ...
        RuntimeError: hvd_dssync: the world changed to 2 ranks, but the schedule 'topology' was built ...
    """
    schedule = arguments.get("schedule", "shuffle")
    if not (schedule is None or isinstance(schedule, str)) or schedule == "topology" \
            or arguments.get("topology") is not None:
        raise RuntimeError(f"hvd_dssync: the world changed to {world_size} ranks, but the schedule {schedule!r} "
                           "was built for a fixed set of ranks; elastic training needs schedule='shuffle' or "
                           "'butterfly'.")
    arguments = dict(arguments)
    for key in ("num_groups", "group_size"):
        if arguments.get(key) is not None:
            arguments[key] = min(arguments[key], world_size)
    return arguments


def refuse_topology_in_process_set(in_process_set, schedule, topology):
    """Refuse the topology-aware schedule inside a process set, naming ``process_set``: finding the hosts is a
    collective over all ranks. Both adapters call it (:meth:`SyncConfig.resolve`); no communication.

    Example::

        >>> refuse_topology_in_process_set(True, "shuffle", None)
        >>> refuse_topology_in_process_set(True, None, "auto")  # the default: nothing is sensed in a set
        >>> refuse_topology_in_process_set(True, "topology", None)
        Traceback (most recent call last):
        ...
        ValueError: Arg ``process_set``: schedule='topology' and ``topology`` are not supported inside a process set ...
    """
    if in_process_set and ((topology is not None and not _is_auto(topology)) or schedule == "topology"):
        raise ValueError("Arg ``process_set``: schedule='topology' and ``topology`` are not supported inside a "
                         "process set (finding the hosts is a collective over all ranks); use 'shuffle' or "
                         "'butterfly'.")


def _integer(name, value):
    """The type half of the schedules' integer check (:func:`hvd_dssync.schedules.base._check_int`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Arg ``{name}`` must be an integer, got {value!r}.")


def _check_schedule(schedule, resolved, num_groups, group_size, seed):
    """The schedule's arguments checked as :func:`hvd_dssync.schedules.make_schedule` and the schedules check
    them (the same errors, in the same order), but for what needs the world size."""
    if isinstance(schedule, Schedule):
        return
    _integer("seed", seed)
    if not isinstance(resolved, str):
        if not callable(getattr(schedule, "groups", None)):
            raise TypeError(f"Arg ``schedule`` must be a name in {SCHEDULE_NAMES} or an object with a "
                            f"groups(step) method, got {schedule!r}.")
    elif resolved == "shuffle":
        if num_groups is not None and group_size is not None:
            raise ValueError("Pass exactly one of ``num_groups`` and ``group_size`` "
                             f"(got num_groups={num_groups!r}, group_size={group_size!r}).")
        if num_groups is not None:
            _check_int("num_groups", num_groups, 1)
        elif group_size is not None:
            _check_int("group_size", group_size, 1)
        _check_int("seed", seed, 0)
    elif resolved == "butterfly":
        if num_groups is not None:
            raise ValueError("Arg ``num_groups`` does not apply to schedule='butterfly'; give ``group_size``.")
        if group_size is not None:  # its least value depends on the world size: the schedule checks it
            _integer("group_size", group_size)
    elif resolved != "topology":
        raise ValueError(f"Arg ``schedule`` must be one of {SCHEDULE_NAMES} or a schedule object, got {schedule!r}.")


def _is_auto(topology):
    return isinstance(topology, str) and topology == AUTO
