"""Averaging inside racks, crossing the slow links with few groups (:class:`TopologyAware`)."""
import math

from .base import Bridge, GlobalRoute, Schedule, _check_int, canonical_partition

__all__ = ["TopologyAware"]


class TopologyAware(Schedule):
    """Keep averaging inside racks; cross each slow link with at most ``max_cross_groups`` groups.

    A period is ``intra_steps`` steps in which every rack averages on its own, then one *bridge* step in
    which ``max_cross_groups`` bridge ranks from each rack form groups across all racks while the rest of
    each rack averages inside the rack.

    The bridge ranks stay the same by default: after a step inside the racks every member of a rack holds
    the rack's model, so whichever member crosses carries the same thing, and each rank is in two process
    sets (its rack, and its bridge group or the rest of its rack). Horovod negotiates every set a rank
    belongs to on every cycle, so fewer sets make every collective cheaper (docs/tuning.md has the bench's
    figure against bridges that rotate). They are the last ranks of their racks: a bridge rank's own model
    misses its rack's average at the bridge step, so the job's rank 0, which checkpoints and logs in
    Horovod's recipes, is never one where its rack has another rank. With ``rotate_every`` the bridge ranks
    change every that many periods (from the last rank down), each window holding one choice of bridges;
    ``intra_steps=0`` needs it, since the bridge ranks would otherwise never average with their own racks.

    Args:
        topology: a :class:`hvd_dssync.topology.Topology`.
        intra_steps: rack-local steps between bridge steps (0 makes every step a bridge step; ``None``: no
            bridge step, the racks meet only in the global averages of ``global_every``).
        max_cross_groups: groups that may cross the slow links at a bridge step.
        rotate_every: periods before the bridge ranks change; ``None`` (the default) keeps the first
            bridges forever (one endless window: static process sets).
        exact_bridges: carry the bridge's move into the rack's next average (True, the default), or average
            the bridge group plainly (False).
        global_via_bridges: a global average (``global_every``) goes through the racks and one bridge rank
            of each (:class:`hvd_dssync.schedules.GlobalRoute`: one model over each slow link each way);
            False (the default) averages over every rank at once. The PyTorch adapter's only: True is
            refused where it cannot be honoured, ``"auto"`` (the default on racks in the PyTorch adapter)
            averages over every rank at once there (:func:`hvd_dssync.plan.routes_global_averages`).

    Example::

        >>> from hvd_dssync.topology import Topology
        >>> t = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]), intra_steps=1)
        >>> t.groups(0), t.groups(1)
        (((0, 1), (2, 3)), ((0,), (1, 3), (2,)))
    """

    def __init__(self, topology, intra_steps=3, max_cross_groups=1, rotate_every=None, exact_bridges=True,
                 global_via_bridges=False):
        if not isinstance(exact_bridges, bool):
            raise TypeError(f"Arg ``exact_bridges`` must be True or False, got {exact_bridges!r}.")
        if not (isinstance(global_via_bridges, bool) or global_via_bridges == "auto"):
            raise TypeError(f"Arg ``global_via_bridges`` must be True, False or \"auto\", got {global_via_bridges!r}.")
        self.exact_bridges = exact_bridges
        self.global_via_bridges = global_via_bridges
        self.topology = topology
        self.world_size = topology.world_size
        self.intra_steps = None if intra_steps is None else _check_int("intra_steps", intra_steps, 0)
        self.max_cross_groups = _check_int("max_cross_groups", max_cross_groups, 1)
        self.rotate_every = None if rotate_every is None else _check_int("rotate_every", rotate_every, 1)
        if self.intra_steps is None and self.rotate_every is not None:
            raise ValueError("Arg ``rotate_every`` rotates the bridges of bridge steps, but intra_steps=None has "
                             "none; leave rotate_every=None.")
        self.racks = tuple(tuple(r) for r in topology.rack_ranks() if r)
        self._rack_of = {rank: i for i, rack in enumerate(self.racks) for rank in rack}
        # Fixed bridges with no step inside the racks leave a rack's other ranks apart from its bridges for
        # good, unless every rack is one rank (then the bridge group is everyone).
        if self.rotate_every is None and self.intra_steps == 0 and len(self.racks) > 1 \
                and any(len(r) > 1 for r in self.racks):
            raise ValueError("Arg ``rotate_every``: fixed bridges (None) need ``intra_steps`` >= 1; with "
                             "intra_steps=0 the bridge ranks would never average with their own racks. "
                             "Pass rotate_every=1 (or more).")
        self.window_steps = None if self.rotate_every is None else self.cycle * self.rotate_every
        self._cache = {}

    def partitions(self, window):
        cached = self._cache.get(window)
        if cached is None:
            intra = canonical_partition(self.racks)
            if self.intra_steps is None:
                cached = (intra,)
            else:
                cached = (intra,) * self.intra_steps + (self._bridge_partition(window),)
            self._cache = {window: cached}
        return cached

    def _bridges(self, window):
        """The bridge groups of ``window``: the ``k``-th holds the ``k``-th bridge rank of every rack that has
        one, so the first holds one rank of every rack."""
        bridges = [[] for _ in range(self.max_cross_groups)]
        for rack in self.racks:
            for k in range(min(self.max_cross_groups, len(rack))):
                # From the rack's last rank down, so that rank 0 crosses last (see the class docstring).
                bridges[k].append(rack[-1 - (window * self.max_cross_groups + k) % len(rack)])
        return [b for b in bridges if b]

    def _bridge_partition(self, window):
        if len(self.racks) == 1:
            return canonical_partition(self.racks)
        bridges = self._bridges(window)
        chosen = {r for b in bridges for r in b}
        stay = [rest for rest in ([r for r in rack if r not in chosen] for rack in self.racks) if rest]
        return canonical_partition(bridges + stay)

    def global_route(self, rank, step):
        """With ``global_via_bridges`` and two racks or more, how ``rank`` takes part in a global average at
        schedule step ``step`` (:class:`hvd_dssync.schedules.GlobalRoute`): its rack, its group of the
        window's bridge step, whether it speaks for its rack (the first bridge group's ranks) and its scale
        (``|rack| * racks / world_size``). Every group is one the window registers already."""
        if not self.global_via_bridges or len(self.racks) == 1:
            return None
        window = self.window_of(step)
        rack = self.racks[self._rack_of[rank]]
        speakers = self._bridges(window)[0]
        group = next(g for g in self._bridge_partition(window) if rank in g)
        speaks = rank in speakers
        scale = len(rack) * len(speakers) / self.world_size if speaks else 1.0
        return GlobalRoute(rack=rack, group=group, speaks=speaks, scale=scale)

    def crosses(self, group):
        """Whether ``group`` spans more than one rack (a bridge group does).

        Example::

            >>> from hvd_dssync.topology import Topology
            >>> t = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]))
            >>> t.crosses((0, 2)), t.crosses((2, 3))
            (True, False)
        """
        return len({self._rack_of[r] for r in group}) > 1

    def bridge(self, rank, step):
        """How ``rank`` averages at ``step`` when its group there crosses the racks on an exact bridge
        (:class:`hvd_dssync.schedules.Bridge`), else ``None``.

        Each member ``r`` of the bridge group speaks for its next group ``g_r`` (the step after: its rack),
        shared with the ``b_r`` ranks of ``g_r`` that crossed at ``step``: weight ``w_r = |g_r| / b_r``. The
        bridge's average is the ``w``-weighted mean of what its members send (their models as of their last
        average, each scaled by ``w_r * k / sum(w)`` for ``k`` members, in a plain average); ``r`` adds its
        move to its model and ``w_r - 1`` times it to what it sends in ``g_r``'s average, so that ``g_r``'s
        mean makes the move too. From racks that each agreed on a model at their last average, every rack
        then moves to the average of all ranks' agreed models, plus its own local steps since. ``None``
        where a member's next group crosses the racks as well (``intra_steps=0``): that bridge averages
        plainly.

        Example::

            >>> from hvd_dssync.topology import Topology
            >>> t = TopologyAware(Topology.from_racks([[0, 1, 2, 3], [4, 5]]), intra_steps=1)
            >>> t.groups(1), t.bridge(3, 1), t.bridge(5, 1), t.bridge(0, 1), t.bridge(3, 0)
            (((0, 1, 2), (3, 5), (4,)), Bridge(scale=1.3333333333333333, carry=3.0), Bridge(scale=0.6666666666666666, carry=1.0), None, None)
        """
        group = self.group_of(rank, step)
        if not self.exact_bridges or not self.crosses(group):
            return None
        crossed = {r for g in self.groups(step) if self.crosses(g) for r in g}
        following = self.groups(step + 1)
        weights = {}
        for member in group:
            after = next(g for g in following if member in g)
            if self.crosses(after):
                return None
            weights[member] = len(after) / sum(r in crossed for r in after)
        return Bridge(scale=weights[rank] * len(group) / sum(weights.values()), carry=weights[rank] - 1.0)

    def window_groups(self, window):
        """The groups of the window's steps and, where global averages go through the racks, of its bridge
        step (with ``intra_steps=None`` the window has none: its global averages still use its groups)."""
        groups = super().window_groups(window)
        if self.global_via_bridges and len(self.racks) > 1:
            groups = tuple(sorted(set(groups) | set(self._bridge_partition(window))))
        return groups

    @property
    def cycle(self):
        return 1 if self.intra_steps is None else self.intra_steps + 1

    @property
    def meets_only_in_global_averages(self):
        return self.intra_steps is None and len(self.racks) > 1

    @property
    def has_bridges(self):
        return self.exact_bridges and self.intra_steps is not None and len(self.racks) > 1

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
                "rotate_every": self.rotate_every, "exact_bridges": self.exact_bridges,
                **({"global_via_bridges": self.global_via_bridges} if self.global_via_bridges else {})}
