"""Seeded random partitions (:class:`Shuffle`), redrawn or repaired until each window connects every rank."""
import math
import warnings
from collections import OrderedDict

import numpy as np

from .base import Schedule, _check_int, canonical_partition

__all__ = ["Shuffle"]


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
