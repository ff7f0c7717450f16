"""Who averages with whom at step t.

A *partition* splits the ranks ``0 .. world_size-1`` into disjoint *groups*; DS-Sync averages the model
inside each group of the step's partition. Every schedule here is a pure, deterministic function of its
arguments: each rank evaluates it locally and all ranks agree without communicating.

Steps are cut into *windows* of ``window_steps`` steps (one endless window when it is ``None``). Within a
window the schedule cycles through a short tuple of partitions, so the distinct groups a window uses are
known in advance and few: the adapters register exactly those as Horovod process sets, and every set a
rank belongs to costs time on every Horovod cycle.

Where things are: :mod:`~hvd_dssync.schedules.base` (:class:`Schedule`, partitions),
:mod:`~hvd_dssync.schedules.shuffle`, :mod:`~hvd_dssync.schedules.butterfly`,
:mod:`~hvd_dssync.schedules.topology_aware` and :mod:`~hvd_dssync.schedules.user` (one schedule each);
:func:`make_schedule` is here. Every name is imported from here.
"""
import numpy as np

from .base import SCHEDULE_NAMES, Bridge, GlobalRoute, Schedule, _check_int, canonical_partition, validate_partition
from .butterfly import Butterfly
from .shuffle import Shuffle
from .topology_aware import TopologyAware
from .user import UserSchedule

__all__ = [
    "Schedule",
    "Bridge",
    "GlobalRoute",
    "Shuffle",
    "Butterfly",
    "TopologyAware",
    "UserSchedule",
    "canonical_partition",
    "validate_partition",
    "make_schedule",
    "SCHEDULE_NAMES",
]


def make_schedule(schedule, world_size, num_groups=None, group_size=None, seed=0, topology=None,
                  **options):
    """Build the schedule an adapter was asked for: a name in ``SCHEDULE_NAMES`` or an object.

    ``num_groups``/``group_size``/``seed`` apply to the named schedules; ``topology`` to "topology";
    ``options`` go to the named schedule's constructor (e.g. ``window_steps`` for "shuffle"). A
    :class:`Schedule` is returned as it is (its world size checked); any other object with
    ``groups(step)`` is wrapped in :class:`UserSchedule`.

    Example::

        >>> make_schedule("butterfly", 4)
        Butterfly(world_size=4, group_size=2)
        >>> make_schedule("shuffle", 8, num_groups=2, seed=1, window_steps=None)
        Shuffle(world_size=8, num_groups=2, seed=1, partitions_per_window=2, window_steps=None)
    """
    if isinstance(schedule, Schedule):
        if schedule.world_size != world_size:
            raise ValueError(f"Arg ``schedule`` is for world size {schedule.world_size}, but the job has "
                             f"{world_size} ranks.")
        return schedule
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"Arg ``seed`` must be an integer, got {seed!r}.")
    if not isinstance(schedule, str):
        return UserSchedule(schedule, world_size)
    if schedule == "shuffle":
        return Shuffle(world_size, num_groups=num_groups, group_size=group_size, seed=seed, **options)
    if schedule == "butterfly":
        if num_groups is not None:
            raise ValueError("Arg ``num_groups`` does not apply to schedule='butterfly'; give ``group_size``.")
        return Butterfly(world_size, group_size=2 if group_size is None else group_size, **options)
    if schedule == "topology":
        refuse_sizes_with_topology(num_groups, group_size)
        if topology is None:
            raise ValueError("schedule='topology' needs a topology: pass ``topology=`` (a Topology, a file "
                             "path, or racks as lists of ranks) or set HVD_DSSYNC_TOPOLOGY.")
        return TopologyAware(topology, **options)
    raise ValueError(f"Arg ``schedule`` must be one of {SCHEDULE_NAMES} or a schedule object, got {schedule!r}.")


def refuse_sizes_with_topology(num_groups, group_size, why="schedule='topology'"):
    """Raise a ``ValueError`` naming ``num_groups`` or ``group_size`` when either is given to the
    topology-aware schedule, whose groups are the racks and their bridges (it has no size to set).

    ``why`` says how the schedule came to be topology-aware. A pure function of its arguments: every rank
    raises alike. No communication.

    Example::

        >>> refuse_sizes_with_topology(None, None)
        >>> refuse_sizes_with_topology(3, None)
        Traceback (most recent call last):
        ...
        ValueError: Arg ``num_groups`` does not apply to schedule='topology', whose groups are the racks and ...
    """
    given = {name: value for name, value in (("num_groups", num_groups), ("group_size", group_size))
             if value is not None}
    if given:
        shown = ", ".join(f"{name}={value!r}" for name, value in given.items())
        raise ValueError(f"Arg ``{next(iter(given))}`` does not apply to {why}, whose groups are the racks and "
                         f"their bridges (got {shown}); drop it, or pass schedule='shuffle' (or 'butterfly') to "
                         "set the groups' sizes.")
