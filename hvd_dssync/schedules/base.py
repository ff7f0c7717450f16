"""The base of every schedule: partitions, windows, and the checks all schedules share."""
import abc
from typing import NamedTuple

import numpy as np

__all__ = ["Schedule", "Bridge", "GlobalRoute", "canonical_partition", "validate_partition", "SCHEDULE_NAMES"]

SCHEDULE_NAMES = ("shuffle", "butterfly", "topology")


def canonical_partition(groups):
    """Sort each group and the groups by their smallest rank, as tuples: one spelling per partition.

    Example::

        >>> canonical_partition([[3, 1], [2, 0]])
        ((0, 2), (1, 3))
    """
    return tuple(sorted(tuple(sorted(int(r) for r in g)) for g in groups))


def validate_partition(groups, world_size, what="partition"):
    """Raise ``ValueError`` unless ``groups`` covers every rank of ``range(world_size)`` exactly once.

    Example::

        >>> validate_partition([[0, 1], [2]], 3)
        >>> validate_partition([[0, 1], [1, 2]], 3)
        Traceback (most recent call last):
        ...
        ValueError: partition puts rank 1 in more than one group: [[0, 1], [1, 2]]
    """
    seen = {}
    for group in groups:
        if len(group) == 0:
            raise ValueError(f"{what} has an empty group: {groups}")
        for rank in group:
            if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
                raise ValueError(f"{what} names rank {rank!r}, outside 0..{world_size - 1}: {groups}")
            if rank in seen:
                raise ValueError(f"{what} puts rank {rank} in more than one group: {groups}")
            seen[rank] = True
    if len(seen) != world_size:
        missing = sorted(set(range(world_size)) - set(seen))
        raise ValueError(f"{what} leaves ranks {missing} out of every group: {groups}")


class Bridge(NamedTuple):
    """How a rank averages when it crosses the racks on an *exact bridge* (:meth:`Schedule.bridge`).

    The rank sends not its model but the one it held right after its last average (its rack's, which every
    member of the rack held alike), times ``scale``, so that the bridge's average weighs each rack by the
    ranks it speaks for. The move the average makes (averaged minus what it sent, unscaled) is added to the
    rank's model, and ``carry`` times that move to what it sends in its next group average, so that its
    whole next group makes the same move. Nobody's local steps since the last average are lost.

    Example::

        >>> from hvd_dssync.schedules import TopologyAware
        >>> from hvd_dssync.topology import Topology
        >>> TopologyAware(Topology.from_racks([[0, 1, 2], [3, 4, 5]]), intra_steps=1).bridge(2, 1)
        Bridge(scale=1.0, carry=2.0)
    """
    scale: float
    carry: float


class GlobalRoute(NamedTuple):
    """How a rank takes part in a global average that goes through the racks (:meth:`Schedule.global_route`).

    Three averages, each in a group the schedule already has: ``rack`` averages its models; ``group`` (the
    rank's group at the schedule's bridge step) averages what its members send, where only the *speakers*
    (one bridge rank of each rack) send their rack's average, times ``scale`` so that each rack weighs by its
    ranks; ``rack`` then sums what its speaker holds, the mean of every rank's model, and zeros from the
    others. The speakers' average puts ``2 (k - 1) / k`` of one model each way on the slow links it crosses
    for ``k`` racks (one model for two), where a ring over all ``n`` ranks puts ``2 (n - 1) / n`` of one.

    Example::

        >>> from hvd_dssync.schedules import TopologyAware
        >>> from hvd_dssync.topology import Topology
        >>> t = TopologyAware(Topology.from_racks([[0, 1, 2], [3, 4]]), global_via_bridges=True)
        >>> t.global_route(2, 0), t.global_route(0, 0)
        (GlobalRoute(rack=(0, 1, 2), group=(2, 4), speaks=True, scale=1.2), GlobalRoute(rack=(0, 1, 2), group=(0, 1), speaks=False, scale=1.0))
    """
    rack: tuple
    group: tuple
    speaks: bool
    scale: float


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Arg ``{name}`` must be an integer, got {value!r}.")
    if value < minimum:
        raise ValueError(f"Arg ``{name}`` must be at least {minimum}, got {value}.")
    return int(value)


class Schedule(abc.ABC):
    """Base of all schedules: subclasses say which partitions a window cycles through.

    Step ``t`` lies in window ``w = t // window_steps`` and uses
    ``partitions(w)[(t - w * window_steps) % len(partitions(w))]``. A subclass sets ``world_size`` (and
    ``window_steps`` if its partitions change between windows) and implements :meth:`partitions` and
    :meth:`config`; :meth:`groups`, :meth:`group_of` and :meth:`window_groups` follow.

    Example::

        >>> class Rings(Schedule):
        ...     world_size = 4
        ...     def partitions(self, window):
        ...         return (((0, 1), (2, 3)), ((0, 3), (1, 2)))
        ...     def config(self):
        ...         return {"name": "rings", "world_size": 4}
        >>> Rings().groups(1), Rings().group_of(2, 0), Rings().window_groups(0)
        (((0, 3), (1, 2)), (2, 3), ((0, 1), (0, 3), (1, 2), (2, 3)))
    """

    world_size: int
    window_steps = None
    global_via_bridges = False  # whether global averages go through the racks (:meth:`global_route`)

    @abc.abstractmethod
    def partitions(self, window):
        """Tuple of canonical partitions that window ``window`` cycles through."""

    @abc.abstractmethod
    def config(self):
        """A JSON-able description: equal configs give equal schedules (used in checkpoints and checks)."""

    def window_of(self, step):
        return 0 if self.window_steps is None else step // self.window_steps

    def window_start(self, window):
        return 0 if self.window_steps is None else window * self.window_steps

    def groups(self, step):
        """The partition used at ``step``: a tuple of sorted tuples of ranks."""
        step = _check_int("step", step, 0)
        window = self.window_of(step)
        cycle = self.partitions(window)
        return cycle[(step - self.window_start(window)) % len(cycle)]

    def group_of(self, rank, step):
        """The group containing ``rank`` at ``step``."""
        for group in self.groups(step):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")

    def groups_in(self, start, stop):
        """The distinct groups used by steps ``start <= t < stop``, sorted."""
        found = set()
        window = self.window_of(start)
        while self.window_start(window) < stop:
            first = max(start, self.window_start(window))
            cycle = self.partitions(window)
            steps = stop - first if self.window_steps is None else min(stop, self.window_start(window + 1)) - first
            offset = (first - self.window_start(window)) % len(cycle)
            for i in range(min(steps, len(cycle))):
                found.update(cycle[(offset + i) % len(cycle)])
            if self.window_steps is None:
                break
            window += 1
        return tuple(sorted(found))

    def crosses(self, group):
        """Whether ``group`` spans more than one rack: ``None`` where the schedule knows no racks."""
        return None

    def bridge(self, rank, step):
        """How ``rank`` averages at ``step`` if its group there is an exact bridge (:class:`Bridge`), else
        ``None``: plain averaging, what every schedule but the topology-aware one does."""
        return None

    def global_route(self, rank, step):
        """How ``rank`` takes part in a global average at ``step`` when it goes through the racks
        (:class:`GlobalRoute`), else ``None``: one average over every rank, what every schedule but the
        topology-aware one with ``global_via_bridges`` does."""
        return None

    @property
    def meets_only_in_global_averages(self):
        """Whether some ranks never share a group, so that only global averages (``global_every``) bring them
        together: the topology-aware schedule with no bridge step (``intra_steps=None``) on several racks."""
        return False

    @property
    def cycle(self):
        """Averages after which the kinds of this schedule's groups repeat (the topology-aware schedule's
        rack averages and bridge); 1 where every average is of one kind."""
        return 1

    @property
    def has_bridges(self):
        """Whether any step may be an exact bridge: the adapters then keep each rank's model as it was right
        after its last average, which a bridge sends (:class:`Bridge`)."""
        return False

    def window_groups(self, window):
        """The distinct groups of one window: what must be registered while it runs."""
        return tuple(sorted({g for p in self.partitions(window) for g in p}))

    def windows_repeat(self):
        """After how many windows the partitions repeat: 1 for one endless window, ``None`` when they never
        do (fresh draws every window)."""
        return 1 if self.window_steps is None else None

    def every_group(self):
        """Every group of every window, sorted, when the windows repeat (see :meth:`windows_repeat`); else
        ``None``. All of them can then be registered once, as static process sets."""
        cycle = self.windows_repeat()
        if cycle is None:
            return None
        return tuple(sorted({g for window in range(cycle) for g in self.window_groups(window)}))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"
