"""What a step puts on the links: ring allreduces inside the groups, timed by bandwidth alone.

The link model is in :mod:`hvd_dssync.simulate`'s text.
"""
from typing import NamedTuple

import numpy as np

from ..schedules import _check_int, canonical_partition
from ..topology import Topology
from .partitions import _as_arrays, _check_positive, _partitions

__all__ = ["LinkLoad", "link_load", "schedule_link_loads", "bsp_ring_uplink_bytes", "rack_topology"]

_BITS_PER_BYTE = 8
_GIGA = 1e9


class LinkLoad(NamedTuple):
    """What one step puts on the links (bytes in the busiest direction) and how long it takes.

    Example::

        >>> t = Topology.from_racks([[0, 1], [2, 3]])
        >>> link_load([[0, 2], [1, 3]], t, 1000)   # both pairs cross the racks
        LinkLoad(uplink_bytes=2000.0, cross_rack_bytes=4000.0, host_bytes=1000.0, seconds=1.6e-05)
    """
    uplink_bytes: float   # the busiest rack uplink, in or out
    cross_rack_bytes: float  # all bytes that change racks
    host_bytes: float     # the busiest host NIC, in or out
    seconds: float


class _Links:
    """A topology as arrays: the rack and host index of each rank, and the two rates in bytes/s."""

    def __init__(self, topology):
        n = topology.world_size
        self.rack = np.unique([topology.rack_of(r) for r in range(n)], return_inverse=True)[1].ravel()
        self.host = np.unique(topology.rank_hosts, return_inverse=True)[1].ravel()
        self.uplink_rate = topology.cross_rack_gbps * _GIGA / _BITS_PER_BYTE
        self.nic_rate = topology.intra_rack_gbps * _GIGA / _BITS_PER_BYTE

    def load(self, part, model_bytes):
        # Ring successor of each rank in ``part.order``: the next member of its group, wrapping around.
        nxt = np.arange(1, part.order.size + 1)
        nxt[part.starts + part.sizes - 1] = part.starts
        src, dst = part.order, part.order[nxt]
        hop = np.repeat(2.0 * (part.sizes - 1) / part.sizes * model_bytes, part.sizes)
        uplink, cross_total = self._busiest(self.rack, src, dst, hop)
        nic, _ = self._busiest(self.host, src, dst, hop)
        seconds = max(uplink / self.uplink_rate, nic / self.nic_rate)
        return LinkLoad(uplink, cross_total, nic, seconds)

    @staticmethod
    def _busiest(site, src, dst, hop):
        """The most bytes leaving or entering any one site (rack or host), and the total crossing sites."""
        moving = site[src] != site[dst]
        if not moving.any():
            return 0.0, 0.0
        out = np.bincount(site[src][moving], weights=hop[moving])
        into = np.bincount(site[dst][moving], weights=hop[moving])
        return float(max(out.max(), into.max())), float(hop[moving].sum())


def link_load(groups, topology, model_bytes):
    """The :class:`LinkLoad` of one step in which every group ring-allreduces ``model_bytes`` at once.

    Each group's ring visits its members in sorted rank order (see :mod:`hvd_dssync.simulate` for the model).

    Example::

        >>> t = Topology.from_racks([[0, 1], [2, 3]], cross_rack_gbps=1.0)
        >>> link_load([[0, 1, 2, 3]], t, 1000).uplink_bytes   # 2 (N-1)/N * S with N = 4
        1500.0
    """
    model_bytes = _check_positive("model_bytes", model_bytes)
    canonical = canonical_partition(groups)
    if sum(len(g) for g in canonical) != topology.world_size:
        raise ValueError(f"Arg ``groups`` must cover the topology's {topology.world_size} ranks, got {groups}.")
    return _Links(topology).load(_as_arrays(canonical), model_bytes)


def schedule_link_loads(schedule, topology, model_bytes, steps, start=0):
    """The :class:`LinkLoad` of each step ``start .. start + steps - 1``, as a list.

    Example::

        >>> from hvd_dssync.schedules import Butterfly
        >>> t = Topology.from_racks([[0, 1], [2, 3]])
        >>> [l.uplink_bytes for l in schedule_link_loads(Butterfly(4), t, 1000, 2)]
        [0.0, 2000.0]
    """
    model_bytes = _check_positive("model_bytes", model_bytes)
    if topology.world_size != schedule.world_size:
        raise ValueError(f"Arg ``topology`` has {topology.world_size} ranks, the schedule "
                         f"{schedule.world_size}.")
    start = _check_int("start", start, 0)
    steps = _check_int("steps", steps, 0)
    links = _Links(topology)
    loads, cache = [], {}
    for groups, part in _partitions(schedule, start, start + steps):
        load = cache.get(groups)
        if load is None:
            if len(cache) >= 64:
                cache.clear()
            load = cache[groups] = links.load(part, model_bytes)
        loads.append(load)
    return loads


def bsp_ring_uplink_bytes(world_size, num_racks, model_bytes):
    """Closed form: bytes on each rack uplink, each way, for one ring allreduce over all ranks in order.

    With racks of consecutive ranks, the ring ``0 -> 1 -> ... -> N-1 -> 0`` leaves and enters each of
    ``R >= 2`` racks exactly once, and each hop carries ``2 (N - 1) / N * S``; with one rack nothing
    crosses.

    Example::

        >>> bsp_ring_uplink_bytes(8, 2, 800)
        1400.0
    """
    world_size = _check_int("world_size", world_size, 1)
    num_racks = _check_int("num_racks", num_racks, 1)
    model_bytes = _check_positive("model_bytes", model_bytes)
    if num_racks == 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * model_bytes


def rack_topology(world_size, rack_size, intra_rack_gbps=10.0, cross_rack_gbps=1.0):
    """Racks of ``rack_size`` consecutive ranks (the last may be smaller), one rank per host.

    Example::

        >>> rack_topology(6, 4).rack_ranks()
        [[0, 1, 2, 3], [4, 5]]
    """
    world_size = _check_int("world_size", world_size, 1)
    rack_size = _check_int("rack_size", rack_size, 1)
    racks = [list(range(i, min(i + rack_size, world_size))) for i in range(0, world_size, rack_size)]
    return Topology.from_racks(racks, intra_rack_gbps=float(intra_rack_gbps), cross_rack_gbps=float(cross_rack_gbps))
