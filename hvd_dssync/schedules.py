"""Who averages with whom at step t.

A *partition* splits the ranks ``0 .. world_size-1`` into disjoint *groups*; DS-Sync averages the model
inside each group of the step's partition. Every schedule here is a pure, deterministic function of its
arguments: each rank evaluates it locally and all ranks agree without communicating.

Steps are cut into *windows* of ``window_steps`` steps (one endless window when it is ``None``). Within a
window the schedule cycles through a short tuple of partitions, so the distinct groups a window uses are
known in advance and few: the adapters register exactly those as Horovod process sets, and every set a
rank belongs to costs time on every Horovod cycle.
"""
import abc
import math
import warnings
from collections import OrderedDict

import numpy as np

__all__ = [
    "Schedule",
    "Shuffle",
    "Butterfly",
    "TopologyAware",
    "UserSchedule",
    "canonical_partition",
    "validate_partition",
    "make_schedule",
    "SCHEDULE_NAMES",
]

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

    def index_in_window(self, step):
        """Index into ``partitions(window_of(step))`` of the partition used at ``step``."""
        window = self.window_of(step)
        return (step - self.window_start(window)) % len(self.partitions(window))

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


def _sizes_to_num_groups(world_size, num_groups, group_size):
    if (num_groups is None) == (group_size is None):
        raise ValueError(
            "Pass exactly one of ``num_groups`` and ``group_size`` "
            f"(got num_groups={num_groups!r}, group_size={group_size!r})."
        )
    if num_groups is not None:
        num_groups = _check_int("num_groups", num_groups, 1)
        if num_groups > world_size:
            raise ValueError(f"Arg ``num_groups`` must be at most the world size {world_size}, got {num_groups}.")
        return num_groups
    group_size = _check_int("group_size", group_size, 1)
    if group_size > world_size:
        raise ValueError(f"Arg ``group_size`` must be at most the world size {world_size}, got {group_size}.")
    return math.ceil(world_size / group_size)


class Shuffle(Schedule):
    """Seeded random partitions into ``num_groups`` groups whose sizes differ by at most one.

    Each window of ``window_steps`` steps draws ``partitions_per_window`` random partitions from a
    generator seeded by ``(seed, window)`` and cycles through them. Where a draw leaves some ranks
    unconnected, ranks are swapped between groups of the last partition, and the window is drawn again
    (up to 16 times) until its groups connect every rank, so that each window mixes all ranks. This is
    tested for groups of two or more (``num_groups <= N / 2``); with mostly one-rank groups, where the
    window has barely the ``N - 1`` links it needs, a window may still end unconnected, and sizes that
    cannot connect at all get a warning. Few partitions per window keep few
    process sets live per rank (each costs time on every Horovod cycle); fresh windows keep the shuffle
    exploring. ``window_steps=None`` draws once and cycles forever (static process sets are possible).

    Args:
        world_size: number of ranks.
        num_groups: how many groups per step (give this or ``group_size``).
        group_size: the largest group size; ``num_groups = ceil(world_size / group_size)``.
        seed: integer seed shared by all ranks.
        partitions_per_window: distinct partitions a window cycles through (default 2).
        window_steps: steps per window, or ``None`` (the default) for one endless window. Endless
            windows cycle through the same connected partitions forever, as the DS-Sync authors' code
            does, and allow static process sets (``hvd_dssync.torch.init``), which spare Horovod a global
            exchange every cycle (docs/benchmarks.md has the measured per-step costs). Finite windows
            explore more partitions but need dynamic process sets.

    Example::

        >>> s = Shuffle(8, num_groups=2, seed=0)
        >>> len(s.groups(0)), sorted(r for g in s.groups(0) for r in g) == list(range(8))
        (2, True)
    """

    def __init__(self, world_size, num_groups=None, group_size=None, seed=0, partitions_per_window=2,
                 window_steps=None):
        self.world_size = _check_int("world_size", world_size, 1)
        self.num_groups = _sizes_to_num_groups(self.world_size, num_groups, group_size)
        self.seed = _check_int("seed", seed, 0)
        self.partitions_per_window = _check_int("partitions_per_window", partitions_per_window, 1)
        self.window_steps = None if window_steps is None else _check_int("window_steps", window_steps, 1)
        self._cache = OrderedDict()
        # A window's groups add at most (N - num_groups) links per partition; N - 1 are needed.
        links = self.partitions_per_window * (self.world_size - self.num_groups)
        self._can_connect = self.num_groups > 1 and links >= self.world_size - 1
        if self.num_groups > 1 and not self._can_connect:
            warnings.warn(f"Shuffle({self.world_size}, num_groups={self.num_groups}, partitions_per_window="
                          f"{self.partitions_per_window}) cannot connect all ranks within a window; ranks mix "
                          "only across windows. Use fewer groups or more partitions per window.")

    def partitions(self, window):
        cached = self._cache.get(window)
        if cached is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, window]))
            for _ in range(16):
                drawn = [[list(g) for g in np.array_split(rng.permutation(self.world_size), self.num_groups)]
                         for _ in range(self.partitions_per_window)]
                if not self._can_connect or _connect_by_swaps(drawn):
                    break
            cached = tuple(canonical_partition(p) for p in drawn)
            self._cache[window] = cached
            if len(self._cache) > 8:
                self._cache.popitem(last=False)
        return cached

    def config(self):
        return {"name": "shuffle", "world_size": self.world_size, "num_groups": self.num_groups,
                "seed": self.seed, "partitions_per_window": self.partitions_per_window,
                "window_steps": self.window_steps}


def _components(partitions):
    """Component label of each rank in the union of the partitions' groups (union-find)."""
    parent = list(range(sum(len(g) for g in partitions[0])))

    def root(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for partition in partitions:
        for group in partition:
            for r in group[1:]:
                parent[root(r)] = root(group[0])
    return [root(r) for r in range(len(parent))]


def _connects(partitions):
    """Whether the union of the partitions' groups joins every rank to every other."""
    return len(set(_components(partitions))) == 1


def _connect_by_swaps(partitions):
    """Swap ranks between groups of the last partition until the window connects all ranks.

    Moving rank x of group A into group B (and B's rank y of another component into A) links the two
    components through A's other members; a swap can also cut a link, so this is a bounded search,
    not a proof: it returns whether the window ends connected. Group sizes are kept. Deterministic.
    """
    last = partitions[-1]
    for _ in range(sum(len(g) for g in last)):
        label = _components(partitions)
        if len(set(label)) == 1:
            return True
        for a, group_a in enumerate(last):
            if len(group_a) < 2:
                continue
            x = group_a[0]
            swap = next(((b, j) for b, group_b in enumerate(last) if b != a
                         for j, y in enumerate(group_b) if label[y] != label[x]), None)
            if swap is not None:
                b, j = swap
                last[a][0], last[b][j] = last[b][j], x
                break
        else:
            return False
    return _connects(partitions)


def _mixed_radix(world_size, group_size):
    """Factors of ``world_size`` used as butterfly dimensions: each at most ``group_size`` where possible.

    Prime factors larger than ``group_size`` stay whole (such a dimension is one group of that size).
    Factors are merged greedily while their product fits in ``group_size``.
    """
    primes, n, p = [], world_size, 2
    while p * p <= n:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    if n > 1:
        primes.append(n)
    radices = []
    for prime in sorted(primes, reverse=True):
        for i, r in enumerate(radices):
            if r * prime <= group_size:
                radices[i] = r * prime
                break
        else:
            radices.append(prime)
    return tuple(sorted(radices, reverse=True))


class Butterfly(Schedule):
    """Dimension-exchange partitions: step ``t`` averages along digit ``t mod k`` of the rank.

    Ranks are written in the mixed radix ``radices`` (a factorization of ``world_size`` into factors of at
    most ``group_size``); at step ``t`` a group is the ranks that agree on every digit but digit
    ``t mod k``. With no local updates in between, any ``k`` consecutive steps give every rank the exact
    global average. When ``world_size`` is a power of ``group_size`` all groups have ``group_size``
    members and ``k = log_g(N)``; otherwise a prime factor larger than ``group_size`` becomes a dimension
    of its own (for a prime world size, one group of all ranks), so groups may be larger than asked.

    Example::

        >>> Butterfly(4).groups(0), Butterfly(4).groups(1)
        (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    """

    def __init__(self, world_size, group_size=2):
        self.world_size = _check_int("world_size", world_size, 1)
        self.group_size = _check_int("group_size", group_size, 2 if world_size > 1 else 1)
        self.radices = _mixed_radix(self.world_size, self.group_size) if self.world_size > 1 else (1,)
        # The last digit first: {0,1}{2,3} then {0,2}{1,3}, as in the DS-Sync authors' 4-worker code.
        self._cycle = tuple(self._dimension(d) for d in reversed(range(len(self.radices))))

    def _dimension(self, dim):
        digits = np.indices(self.radices).reshape(len(self.radices), -1).T
        ranks = np.ravel_multi_index(digits.T, self.radices)
        groups = {}
        for rank, digit in zip(ranks, digits):
            key = tuple(np.delete(digit, dim))
            groups.setdefault(key, []).append(int(rank))
        return canonical_partition(groups.values())

    @property
    def steps_to_consensus(self):
        return len(self.radices)

    def partitions(self, window):
        return self._cycle

    def config(self):
        return {"name": "butterfly", "world_size": self.world_size, "group_size": self.group_size}


class TopologyAware(Schedule):
    """Keep averaging inside racks; cross each slow link with at most ``max_cross_groups`` groups.

    A period is ``intra_steps`` steps in which every rack averages on its own, then one *bridge* step in
    which ``max_cross_groups`` bridge ranks from each rack form groups across all racks while the rest of
    each rack averages inside the rack.

    The bridge ranks stay the same by default: after a step inside the racks every member of a rack holds
    the rack's model, so whichever member crosses carries the same thing, and each rank is in two process
    sets (its rack, and its bridge group or the rest of its rack). Horovod negotiates every set a rank
    belongs to on every cycle, so fewer sets make every collective cheaper (docs/benchmarks.md: 25% more
    steps on the bench than with bridges that rotate). With ``rotate_every`` the bridge ranks change every
    that many periods, each window holding one choice of bridges; ``intra_steps=0`` needs it, since the
    bridge ranks would otherwise never average with their own racks.

    Args:
        topology: a :class:`hvd_dssync.topology.Topology`.
        intra_steps: rack-local steps between bridge steps (0 makes every step a bridge step).
        max_cross_groups: groups that may cross the slow links at a bridge step.
        rotate_every: periods before the bridge ranks change; ``None`` (the default) keeps the first
            bridges forever (one endless window: static process sets).

    Example::

        >>> from hvd_dssync.topology import Topology
        >>> t = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]), intra_steps=1)
        >>> t.groups(0), t.groups(1)
        (((0, 1), (2, 3)), ((0, 2), (1,), (3,)))
    """

    def __init__(self, topology, intra_steps=3, max_cross_groups=1, rotate_every=None):
        self.topology = topology
        self.world_size = topology.world_size
        self.intra_steps = _check_int("intra_steps", intra_steps, 0)
        self.max_cross_groups = _check_int("max_cross_groups", max_cross_groups, 1)
        self.rotate_every = None if rotate_every is None else _check_int("rotate_every", rotate_every, 1)
        self.racks = tuple(tuple(r) for r in topology.rack_ranks() if r)
        self._rack_of = {rank: i for i, rack in enumerate(self.racks) for rank in rack}
        # Fixed bridges with no step inside the racks leave a rack's other ranks apart from its bridges for
        # good, unless every rack is one rank (then the bridge group is everyone).
        if self.rotate_every is None and self.intra_steps == 0 and len(self.racks) > 1 \
                and any(len(r) > 1 for r in self.racks):
            raise ValueError("Arg ``rotate_every``: fixed bridges (None) need ``intra_steps`` >= 1; with "
                             "intra_steps=0 the bridge ranks would never average with their own racks. "
                             "Pass rotate_every=1 (or more).")
        self.window_steps = None if self.rotate_every is None else (self.intra_steps + 1) * self.rotate_every
        self._cache = {}

    def partitions(self, window):
        cached = self._cache.get(window)
        if cached is None:
            intra = canonical_partition(self.racks)
            cached = (intra,) * self.intra_steps + (self._bridge_partition(window),)
            self._cache = {window: cached}
        return cached

    def _bridge_partition(self, window):
        if len(self.racks) == 1:
            return canonical_partition(self.racks)
        bridges = [[] for _ in range(self.max_cross_groups)]
        stay = []
        for rack in self.racks:
            chosen = set()
            for k in range(min(self.max_cross_groups, len(rack))):
                rank = rack[(window * self.max_cross_groups + k) % len(rack)]
                bridges[k].append(rank)
                chosen.add(rank)
            rest = [r for r in rack if r not in chosen]
            if rest:
                stay.append(rest)
        return canonical_partition([b for b in bridges if b] + stay)

    def crosses(self, group):
        """Whether ``group`` spans more than one rack (a bridge group does).

        Example::

            >>> from hvd_dssync.topology import Topology
            >>> t = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]))
            >>> t.crosses((0, 2)), t.crosses((2, 3))
            (True, False)
        """
        return len({self._rack_of[r] for r in group}) > 1

    def windows_repeat(self):
        """The bridges of a rack of ``n`` ranks come round again after ``n / gcd(n, max_cross_groups)``
        windows; the schedule's after the least common multiple over its racks.

        Example::

            >>> from hvd_dssync.topology import Topology
            >>> t = TopologyAware(Topology.from_racks([[0, 1, 2, 3], [4, 5, 6, 7]]), rotate_every=25)
            >>> t.windows_repeat(), len(t.every_group())
            (4, 14)
        """
        if self.window_steps is None:
            return 1
        return math.lcm(*(len(r) // math.gcd(len(r), self.max_cross_groups) for r in self.racks))

    def config(self):
        return {"name": "topology", "world_size": self.world_size, "racks": [list(r) for r in self.racks],
                "intra_steps": self.intra_steps, "max_cross_groups": self.max_cross_groups,
                "rotate_every": self.rotate_every}


class UserSchedule(Schedule):
    """Wraps any object with ``groups(step)`` (and optionally ``window_steps``) and validates it.

    Each window's partitions are read once from the user's object, checked to cover every rank exactly
    once, and checked to be the same when asked twice. Without ``window_steps`` the object's groups must
    repeat with a period of at most 32 steps (the first 64 are read).

    Example::

        >>> class Pairs:
        ...     world_size = 4
        ...     def groups(self, step):
        ...         return [[0, 1], [2, 3]] if step % 2 == 0 else [[0, 3], [1, 2]]
        >>> UserSchedule(Pairs(), 4).groups(5)
        ((0, 3), (1, 2))
    """

    def __init__(self, schedule, world_size, window_steps=None, check_windows=2):
        if not callable(getattr(schedule, "groups", None)):
            raise TypeError(f"Arg ``schedule`` must be a name in {SCHEDULE_NAMES} or an object with a "
                            f"groups(step) method, got {schedule!r}.")
        self.user = schedule
        self.world_size = _check_int("world_size", world_size, 1)
        declared = getattr(schedule, "world_size", self.world_size)
        if declared != self.world_size:
            raise ValueError(f"schedule {schedule!r} is for world size {declared}, but the job has "
                             f"{self.world_size} ranks.")
        window_steps = getattr(schedule, "window_steps", window_steps)
        self.window_steps = None if window_steps is None else _check_int("window_steps", window_steps, 1)
        self._scan = 64 if self.window_steps is None else self.window_steps
        self._cache = {}
        for window in range(check_windows):
            self.partitions(window)

    def partitions(self, window):
        cached = self._cache.get(window)
        if cached is None:
            start = window * self._scan
            cycle = []
            for step in range(start, start + self._scan):
                first = self.user.groups(step)
                validate_partition(first, self.world_size, what=f"schedule.groups({step})")
                if canonical_partition(self.user.groups(step)) != canonical_partition(first):
                    raise ValueError(f"schedule.groups({step}) returned different partitions when called "
                                     "twice: a schedule must be a deterministic function of the step.")
                cycle.append(canonical_partition(first))
            cached = tuple(cycle)
            if self.window_steps is None:
                cached = cached[:self._period(cached)]
            self._cache = {window: cached}
        return cached

    @staticmethod
    def _period(cycle):
        # An endless window must repeat: groups(t) beyond the scan is taken from one period of the scan, so
        # the period must be seen at least twice in it, and wrapping must use the period, not the scan.
        for period in range(1, len(cycle) // 2 + 1):
            if all(cycle[i] == cycle[i % period] for i in range(len(cycle))):
                return period
        raise ValueError(f"a user schedule without ``window_steps`` must repeat with a period of at most "
                         f"{len(cycle) // 2} steps; give it a ``window_steps`` attribute otherwise.")

    def config(self):
        return {"name": "user", "world_size": self.world_size, "type": type(self.user).__qualname__,
                "window_steps": self.window_steps,
                "first_steps": [self.groups(t) for t in range(min(8, self._scan))]}


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
        if topology is None:
            raise ValueError("schedule='topology' needs a topology: pass ``topology=`` (a Topology, a file "
                             "path, or racks as lists of ranks) or set HVD_DSSYNC_TOPOLOGY.")
        return TopologyAware(topology, **options)
    raise ValueError(f"Arg ``schedule`` must be one of {SCHEDULE_NAMES} or a schedule object, got {schedule!r}.")
