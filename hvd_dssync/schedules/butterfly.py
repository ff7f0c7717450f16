"""Dimension-exchange partitions (:class:`Butterfly`): any ``k`` consecutive steps give the exact average."""
import numpy as np

from .base import Schedule, _check_int, canonical_partition

__all__ = ["Butterfly"]


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
