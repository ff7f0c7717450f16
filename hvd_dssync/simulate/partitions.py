"""Partitions as arrays, shared by the simulator's modules: one vectorised group average per step."""
from typing import NamedTuple

import numpy as np


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or value <= 0:
        raise ValueError(f"Arg ``{name}`` must be a positive number, got {value!r}.")
    return float(value)


class _Partition(NamedTuple):
    """A partition as arrays: ranks listed group after group (``order``), each group's start and size."""
    order: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray


def _as_arrays(groups):
    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
    order = np.fromiter((r for g in groups for r in g), dtype=np.int64, count=int(sizes.sum()))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    return _Partition(order, starts, sizes)


def _partitions(schedule, start, stop):
    """Yield ``(groups, arrays)`` for steps ``start <= t < stop``, converting each distinct partition once."""
    cache = {}
    for step in range(start, stop):
        groups = schedule.groups(step)
        arrays = cache.get(groups)
        if arrays is None:
            # Windows cycle through few partitions; a bound keeps long Shuffle runs from hoarding old ones.
            if len(cache) >= 64:
                cache.clear()
            arrays = cache[groups] = _as_arrays(groups)
        yield groups, arrays


def _group_average(x, part):
    """Replace each row of ``x`` (N x d) by the mean of the rows of its group."""
    means = np.add.reduceat(x[part.order], part.starts, axis=0) / part.sizes[:, None]
    out = np.empty_like(x)
    out[part.order] = np.repeat(means, part.sizes, axis=0)
    return out
