"""Simulate a schedule on N virtual workers: consensus, mixing, and the bytes on the slowest link.

Everything here is numpy on arrays of length N; no N x N matrix is formed except by
:func:`mixing_matrix` (and :func:`spectral_gap` for ``N <= DENSE_LIMIT``), so N = 4096 takes seconds.

**Averaging.** A step averages uniformly inside each group of ``schedule.groups(t)``. Its matrix ``A_t``
is symmetric and doubly stochastic (a projection onto the vectors that are constant on each group), so
the global mean never changes and ``||A_t x - mean|| <= ||x - mean||``: the consensus error cannot grow.
No local updates are simulated: this isolates how fast a schedule mixes.

**Spectral gap.** Over one period of ``p`` steps the product is ``W = A_{p-1} ... A_1 A_0``, doubly
stochastic but in general not symmetric. With ``J = 11^T / N``, ``W J = J W = J`` and ``W`` maps the
vectors orthogonal to ``1`` into themselves, so for every ``x``::

    ||W x - mean(x) 1|| <= sigma ||x - mean(x) 1||,   sigma = ||W - J||_2 = sigma_2(W)

(the largest singular value of ``W`` on the complement of ``1``). The gap is ``1 - sigma``: the
guaranteed fraction by which one period shrinks the distance from consensus, 1 for an exact average,
0 for a schedule that never connects all workers. Singular values rather than eigenvalues because ``W``
is not symmetric: ``|lambda_2(W)| <= sigma`` and only ``sigma`` bounds every period.

**Links.** Racks are joined by a core switch; each rack's uplink (the shared slow link, at
``cross_rack_gbps``, full duplex) carries all traffic leaving the rack in one direction and all traffic
entering it in the other; each host's NIC runs at ``intra_rack_gbps``. Each group of a step runs a ring
allreduce among its members in sorted rank order, all groups at once. A ring of ``m`` ranks over a model
of ``S`` bytes sends, on each hop ``i -> next(i)``, ``m - 1`` chunks of ``S/m`` in the reduce-scatter and
``m - 1`` in the allgather::

    bytes per hop = 2 (m - 1) / m * S        (= what each rank sends; 0 for m = 1)

A hop between racks loads the sender's uplink (out) and the receiver's uplink (in). A step's time is
bandwidth only, ``max(uplink bytes / cross rate, NIC bytes / intra rate)`` over all links: no latency, no
compute, no overlap.

Closed form for bulk-synchronous training (BSP, one ring over all N ranks in rank order) on R >= 2 racks
of consecutive ranks: exactly R hops cross racks (one out of and one into each rack, counting the
wrap-around ``N-1 -> 0``), so every uplink carries ``2 (N - 1) / N * S`` each way and the cross-rack total
is ``R * 2 (N - 1) / N * S``; see :func:`bsp_ring_uplink_bytes`.
"""
import math
from typing import NamedTuple

import numpy as np

from .schedules import Butterfly, Shuffle, TopologyAware, _check_int, canonical_partition
from .topology import Topology

__all__ = [
    "DENSE_LIMIT",
    "TABLE_SCHEDULES",
    "consensus_error",
    "steps_to_error",
    "mixing_matrix",
    "spectral_gap",
    "LinkLoad",
    "link_load",
    "schedule_link_loads",
    "bsp_ring_uplink_bytes",
    "rack_topology",
    "table_schedules",
    "simulate_table",
    "format_table",
]

DENSE_LIMIT = 512
TABLE_SCHEDULES = ("bsp", "shuffle", "butterfly", "topology")
_BITS_PER_BYTE = 8
_GIGA = 1e9


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


def _rms(x):
    return math.sqrt(float(np.vdot(x, x)) / x.shape[0])


def consensus_error(schedule, steps, dim=8, seed=0, start=0):
    """Relative consensus error after each of ``steps`` steps of pure group averaging.

    Each worker starts from a random vector of length ``dim`` (seeded by ``seed``); step ``t`` replaces
    every vector by the mean of its group in ``schedule.groups(t)``. The error is the root mean square
    distance of the workers' vectors from their global mean, divided by the initial one: 1 at the
    start, 0 at exact consensus, never increasing.

    Args:
        schedule: any :class:`hvd_dssync.schedules.Schedule`.
        steps: how many steps to simulate.
        dim: length of each worker's vector (more averages out the luck of the draw).
        seed: seed of the initial vectors.
        start: first step simulated.

    Returns:
        A float array of length ``steps``; entry ``i`` is the error after step ``start + i``.

    Example::

        >>> from hvd_dssync.schedules import Butterfly
        >>> [round(float(e), 6) for e in consensus_error(Butterfly(8), 3)][-1]
        0.0
    """
    steps = _check_int("steps", steps, 0)
    dim = _check_int("dim", dim, 1)
    seed = _check_int("seed", seed, 0)
    start = _check_int("start", start, 0)
    errors = np.zeros(steps)
    if schedule.world_size == 1:
        return errors
    x = np.random.default_rng(seed).standard_normal((schedule.world_size, dim))
    # Averaging keeps the global mean, so centring once makes the error the plain RMS of x.
    x -= x.mean(axis=0)
    initial = _rms(x)
    for i, (_, part) in enumerate(_partitions(schedule, start, start + steps)):
        x = _group_average(x, part)
        errors[i] = _rms(x) / initial
    return errors


def steps_to_error(errors, target=1e-3):
    """The number of steps after which ``errors`` (from :func:`consensus_error`) first reach ``target``.

    ``None`` when they never do within the simulated steps.

    Example::

        >>> steps_to_error([0.5, 0.01, 1e-4], target=1e-3)
        3
    """
    target = _check_positive("target", target)
    reached = np.flatnonzero(np.asarray(errors) <= target)
    return int(reached[0]) + 1 if reached.size else None


def _default_period(schedule, start):
    return len(schedule.partitions(schedule.window_of(start)))


def mixing_matrix(schedule, start=0, period=None):
    """The N x N product ``W = A_{start+p-1} ... A_{start}`` of ``p = period`` averaging steps.

    ``period`` defaults to the length of the cycle of partitions that ``start``'s window uses (for
    example 2 for the default Shuffle, ``steps_to_consensus`` for Butterfly, ``intra_steps + 1`` for
    TopologyAware). ``W[i, j]`` is the weight of worker ``j``'s initial value in worker ``i``'s final
    one. Dense: for tests and small N.

    Example::

        >>> from hvd_dssync.schedules import Butterfly
        >>> bool(np.allclose(mixing_matrix(Butterfly(4)), 0.25))
        True
    """
    start = _check_int("start", start, 0)
    period = _default_period(schedule, start) if period is None else _check_int("period", period, 1)
    w = np.eye(schedule.world_size)
    for _, part in _partitions(schedule, start, start + period):
        w = _group_average(w, part)
    return w


def _sigma_dense(schedule, start, period):
    w = mixing_matrix(schedule, start, period)
    return float(np.linalg.norm(w - 1.0 / schedule.world_size, 2))


def _sigma_iterative(schedule, start, period, block, tol, max_iter):
    """sigma = ||W - J||_2 by block power iteration on ``(W - J)^T (W - J) = W^T W - J``.

    ``W`` is applied as its ``period`` group averagings and ``W^T`` as the same averagings in reverse
    order (each ``A_t`` is symmetric); the mean is projected out, which deflates the eigenvalue 1 of
    the consensus direction. A Rayleigh-Ritz step on the block estimates the top eigenvalue
    ``sigma^2``; iteration stops when it changes by less than ``tol`` (it rises monotonically to the
    true value, faster than the vectors converge).
    """
    parts = [part for _, part in _partitions(schedule, start, start + period)]
    n = schedule.world_size
    q = np.random.default_rng(0).standard_normal((n, min(block, n - 1)))
    q -= q.mean(axis=0)
    q, _ = np.linalg.qr(q)
    previous = -1.0
    for _ in range(max_iter):
        z = q
        for part in parts:
            z = _group_average(z, part)
        for part in reversed(parts):
            z = _group_average(z, part)
        z -= z.mean(axis=0)
        ritz = q.T @ z
        sigma2 = float(np.linalg.eigvalsh((ritz + ritz.T) / 2)[-1])
        if abs(sigma2 - previous) <= tol:
            break
        previous = sigma2
        q, _ = np.linalg.qr(z)
    return math.sqrt(max(sigma2, 0.0))


def spectral_gap(schedule, start=0, period=None, method="auto", tol=1e-12, max_iter=5000, block=8):
    """``1 - sigma_2(W)`` for the product ``W`` of one period of the schedule (see the module docstring).

    The gap is the fraction of the distance from consensus that one period removes at least: 1 when a
    period gives the exact global average (Butterfly), 0 when it leaves some workers unconnected.

    Args:
        schedule: any :class:`hvd_dssync.schedules.Schedule`.
        start, period: the steps ``start .. start + period - 1`` (see :func:`mixing_matrix`).
        method: "dense" forms ``W`` and takes its SVD; "iterative" never forms it and runs block power
            iteration on ``W^T W - J`` applied through group means (O(N) memory per vector); "auto" is
            dense up to ``DENSE_LIMIT`` workers.
        tol, max_iter, block: the iterative method's stop on the change of ``sigma^2``, its iteration
            cap, and its block size.

    Example::

        >>> from hvd_dssync.schedules import Butterfly
        >>> round(spectral_gap(Butterfly(16)), 9)
        1.0
    """
    start = _check_int("start", start, 0)
    period = _default_period(schedule, start) if period is None else _check_int("period", period, 1)
    if method not in ("auto", "dense", "iterative"):
        raise ValueError(f"Arg ``method`` must be 'auto', 'dense' or 'iterative', got {method!r}.")
    if schedule.world_size == 1:
        return 1.0
    if method == "dense" or (method == "auto" and schedule.world_size <= DENSE_LIMIT):
        sigma = _sigma_dense(schedule, start, period)
    else:
        sigma = _sigma_iterative(schedule, start, period, _check_int("block", block, 1),
                                 _check_positive("tol", tol), _check_int("max_iter", max_iter, 1))
    return 1.0 - sigma


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

    Each group's ring visits its members in sorted rank order (see the module docstring for the model).

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


def table_schedules(world_size, topology, names=TABLE_SCHEDULES, num_groups=None, group_size=4, seed=0):
    """The contenders of :func:`simulate_table` for one world size, as ``{name: schedule}``.

    - "bsp": one group of all ranks (one ring allreduce in rank order per step; it reaches consensus in
      one step, as BSP's gradient allreduce keeps the models identical).
    - "shuffle": :class:`Shuffle` with ``num_groups`` groups, or groups of at most ``group_size``.
    - "butterfly": :class:`Butterfly` with ``group_size``.
    - "topology": :class:`TopologyAware` on ``topology`` with its defaults (3 rack-local steps, then
      one bridge step with one group across the racks).

    Example::

        >>> sorted(table_schedules(8, rack_topology(8, 4)))
        ['bsp', 'butterfly', 'shuffle', 'topology']
    """
    unknown = [n for n in names if n not in TABLE_SCHEDULES]
    if unknown:
        raise ValueError(f"Arg ``names`` must name schedules in {TABLE_SCHEDULES}, got {unknown}.")
    group_size = _check_int("group_size", group_size, 2)
    builders = {
        "bsp": lambda: Shuffle(world_size, num_groups=1, partitions_per_window=1, window_steps=None),
        "shuffle": lambda: Shuffle(world_size, num_groups=num_groups,
                                   group_size=None if num_groups else min(group_size, world_size), seed=seed),
        "butterfly": lambda: Butterfly(world_size, group_size=group_size),
        "topology": lambda: TopologyAware(topology),
    }
    return {name: builders[name]() for name in names}


def _group_sizes(schedule, period):
    sizes = {len(g) for t in range(period) for g in schedule.groups(t)}
    return str(min(sizes)) if len(sizes) == 1 else f"{min(sizes)}-{max(sizes)}"


def simulate_table(workers=(8, 64, 512, 4096), schedules=TABLE_SCHEDULES, num_groups=None, group_size=4,
                   rack_size=8, intra_rack_gbps=10.0, cross_rack_gbps=1.0, model_bytes=100e6,
                   error_steps=10, max_steps=1000, target=1e-3, dim=8, seed=0, average_every=1):
    """One row per (world size, schedule): how fast it mixes and what it costs the slow links.

    Racks hold ``rack_size`` consecutive ranks; when a world size is not larger than ``rack_size`` the
    racks hold half the ranks instead, so there is always a slow link to cross. Link figures are means
    over the ``max_steps`` simulated steps (a schedule's steps differ: TopologyAware crosses racks one
    step in four).

    Row keys: ``workers``, ``schedule``, ``racks``, ``group_sizes`` (over the first period), ``error_after``
    (consensus error after ``error_steps`` steps), ``spectral_gap`` and ``period``, ``steps_to_target``
    (``None`` if not within ``max_steps``, also a key), ``uplink_mb_per_step`` (busiest rack uplink, 1 MB = 1e6
    bytes), ``time_ms_per_step``, and ``speedup_vs_bsp`` (BSP's time per step over this one's).

    With ``average_every=H`` the DS-Sync schedules (not "bsp") average on one step in ``H`` (local steps
    between, :class:`hvd_dssync.policy.Policy`): ``max_steps`` averaging rounds are simulated, a round
    reaching the target at step ``k H``, and the link figures per step are a round's divided by ``H``.

    Example::

        >>> rows = simulate_table(workers=(8,), schedules=("bsp", "butterfly"), max_steps=20)
        >>> [(r["schedule"], r["steps_to_target"]) for r in rows]
        [('bsp', 1), ('butterfly', 2)]
    """
    error_steps = _check_int("error_steps", error_steps, 1)
    max_steps = _check_int("max_steps", max_steps, error_steps)
    rack_size = _check_int("rack_size", rack_size, 1)
    average_every = _check_int("average_every", average_every, 1)
    bsp_time = {}
    rows = []
    for n in workers:
        n = _check_int("workers", n, 2)
        topology = rack_topology(n, rack_size if n > rack_size else max(1, n // 2), intra_rack_gbps, cross_rack_gbps)
        bsp_time[n] = _Links(topology).load(_as_arrays((tuple(range(n)),)), model_bytes).seconds
        built = table_schedules(n, topology, schedules, num_groups=num_groups, group_size=group_size, seed=seed)
        for name, schedule in built.items():
            errors = consensus_error(schedule, max_steps, dim=dim, seed=seed)
            loads = schedule_link_loads(schedule, topology, model_bytes, max_steps)
            period = _default_period(schedule, 0)
            every = 1 if name == "bsp" else average_every
            seconds = float(np.mean([l.seconds for l in loads])) / every
            rounds = steps_to_error(errors, target)
            done = error_steps // every
            rows.append({
                "workers": n,
                "schedule": name,
                "racks": topology.num_racks,
                "group_sizes": _group_sizes(schedule, period),
                "error_after": float(errors[done - 1]) if done else 1.0,
                "error_steps": error_steps,
                "spectral_gap": spectral_gap(schedule),
                "period": period,
                "steps_to_target": None if rounds is None else rounds * every,
                "target": target,
                "max_steps": max_steps * every,
                "average_every": every,
                "uplink_mb_per_step": float(np.mean([l.uplink_bytes for l in loads])) / 1e6 / every,
                "time_ms_per_step": seconds * 1e3,
                "speedup_vs_bsp": bsp_time[n] / seconds if seconds > 0 else math.inf,
            })
    return rows


def format_table(rows):
    """The rows of :func:`simulate_table` as a markdown table.

    Example::

        >>> print(format_table(simulate_table(workers=(4,), schedules=("bsp",), max_steps=10)))
        ... # doctest: +NORMALIZE_WHITESPACE
        | N | racks | schedule | group size | err@10 | gap (period) | steps to 1e-03 | uplink MB/step | ms/step | vs BSP |
        |--:|--:|:--|--:|--:|--:|--:|--:|--:|--:|
        | 4 | 2 | bsp | 4 | 0 | 1 (1) | 1 | 150 | 1200 | 1.00x |
    """
    if not rows:
        return ""
    first = rows[0]
    header = ["N", "racks", "schedule", "group size", f"err@{first['error_steps']}", "gap (period)",
              f"steps to {first['target']:.0e}", "uplink MB/step", "ms/step", "vs BSP"]
    lines = ["| " + " | ".join(header) + " |", "|--:|--:|:--|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        steps = r["steps_to_target"]
        cells = [r["workers"], r["racks"], r["schedule"], r["group_sizes"], _short(r["error_after"]),
                 f"{_short(r['spectral_gap'])} ({r['period']})", f"> {r['max_steps']}" if steps is None else steps,
                 f"{r['uplink_mb_per_step']:.3g}", f"{r['time_ms_per_step']:.4g}", f"{r['speedup_vs_bsp']:.2f}x"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _short(value):
    """Three significant digits; values within 1e-12 of 0 or 1 (rounding noise of an exact average) as 0, 1."""
    if abs(value) < 1e-12:
        return "0"
    if abs(value - 1) < 1e-12:
        return "1"
    return f"{value:.3g}"


def parse_rate_changes(text):
    """Link rates over (simulated) time: ``"t=30:inter=4,t=60:inter=40"`` or the path of a JSON timetable.

    Each change names a time ``t`` in seconds and new rates in Gb/s: ``inter`` (the rack uplinks) and/or
    ``intra`` (the host NICs). A JSON timetable is a list of objects with the same keys. Returns the
    changes as ``[(t, {"inter": ..., "intra": ...}), ...]`` sorted by time.

    Example::

        >>> parse_rate_changes("t=60:inter=40,t=30:inter=4:intra=5")
        [(30.0, {'inter': 4.0, 'intra': 5.0}), (60.0, {'inter': 40.0})]
    """
    import json
    import os

    if text.endswith(".json") and os.path.exists(text):
        with open(text) as f:
            entries = [{k: str(v) for k, v in entry.items()} for entry in json.load(f)]
    else:
        entries = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            fields = dict(field.partition("=")[::2] for field in item.split(":"))
            entries.append(fields)
    changes = []
    for entry in entries:
        unknown = sorted(set(entry) - {"t", "inter", "intra"})
        if "t" not in entry or unknown or len(entry) < 2:
            raise ValueError(f"Arg ``rate_changes``: each change needs t= and inter= and/or intra= (Gb/s), "
                             f"got {entry!r}.")
        try:
            values = {k: float(v) for k, v in entry.items()}
        except ValueError:
            raise ValueError(f"Arg ``rate_changes``: numbers expected, got {entry!r}.") from None
        if values["t"] < 0 or any(v <= 0 for k, v in values.items() if k != "t"):
            raise ValueError(f"Arg ``rate_changes``: t must be >= 0 and rates > 0, got {entry!r}.")
        changes.append((values.pop("t"), values))
    return sorted(changes, key=lambda change: change[0])


def replay_adaptive(world_size=64, rack_size=8, steps=1000, rate_changes=(), intra_rack_gbps=10.0,
                    cross_rack_gbps=1.0, model_bytes=100e6, compute_seconds=0.2, policy=None):
    """Replay a network whose rates change over time under the adaptive policy, and under each fixed mode.

    Every step computes for ``compute_seconds``, then averages as :class:`hvd_dssync.adaptive.AdaptiveState`
    says (deciding as the PyTorch adapter does, inside windows too): globally (one ring over all ranks) or in the groups of :class:`TopologyAware` (racks, with a bridge
    step), timed by the link model of this module at the rates in force (:func:`parse_rate_changes`). All
    ranks see the same figures here (no stragglers), so the decisions are those of one rank; drift is not
    modelled. Returns ``{"decisions": [...], "seconds": {"adaptive": ..., "global": ..., "group": ...}}``:
    each decision's dict with the simulated time ``t`` it was taken at, and the simulated time of the
    ``steps`` steps under each policy.

    Example::

        >>> from hvd_dssync.adaptive import AdaptivePolicy
        >>> out = replay_adaptive(world_size=16, steps=512, cross_rack_gbps=40, policy=AdaptivePolicy(decide_every=16),
        ...                       rate_changes=parse_rate_changes("t=30:inter=2,t=80:inter=40"))
        >>> [(d["step"], round(d["t"]), d["mode"]) for d in out["decisions"] if d["reason"] != "unchanged"]
        [(15, 3, 'global'), (94, 33, 'group'), (255, 96, 'global')]
        >>> {k: round(v) for k, v in out["seconds"].items()}  # group averages keep saving 3%, but models drift
        {'adaptive': 185, 'global': 211, 'group': 182}
    """
    from .adaptive import AdaptivePolicy, AdaptiveState
    from .plan import first_crossing
    from .policy import GLOBAL, GROUP

    world_size = _check_int("world_size", world_size, 2)
    steps = _check_int("steps", steps, 1)
    compute_seconds = _check_positive("compute_seconds", compute_seconds)
    policy = policy or AdaptivePolicy()
    rack_size = _check_int("rack_size", rack_size, 1) if world_size > rack_size else max(1, world_size // 2)
    schedule = TopologyAware(rack_topology(world_size, rack_size))
    everyone = _as_arrays((tuple(range(world_size)),))
    first_average = first_crossing(schedule, 0, policy.first_averages())

    def run(forced):
        state = AdaptiveState(policy, first_average=first_average)
        clock, pending, cache, decisions = 0.0, list(rate_changes), {}, []
        rates = {"inter": float(cross_rack_gbps), "intra": float(intra_rack_gbps)}
        for step in range(steps):
            while pending and pending[0][0] <= clock:
                rates.update(pending.pop(0)[1])
            early = state.early_figures(step)  # every rank's are alike
            if early is not None and forced is None:
                decision = state.check_early(step, early)
                if decision is not None:
                    decisions.append(dict(decision.as_dict(), t=clock))
            kind = state.action(step) if forced is None else forced
            seconds = 0.0
            if kind in (GLOBAL, GROUP):
                groups = schedule.groups(state.schedule_step(step)) if kind == GROUP else None
                key = (groups, rates["inter"], rates["intra"])
                if key not in cache:
                    links = _Links(rack_topology(world_size, rack_size, rates["intra"], rates["inter"]))
                    part = everyone if groups is None else _as_arrays(canonical_partition(groups))
                    cache[key] = links.load(part, model_bytes).seconds
                seconds = cache[key]
            clock += compute_seconds + seconds
            if forced is not None:
                state.record(kind, seconds, compute_seconds)
                continue
            decision = state.end_step(step, kind, seconds, compute_seconds, gathered=state.carried_figures(step),
                                      gather=lambda figures: figures)  # every rank's figures are this one's
            if decision is not None:
                decisions.append(dict(decision.as_dict(), t=clock))
        return clock, decisions

    adaptive_seconds, decisions = run(None)
    return {"decisions": decisions, "seconds": {"adaptive": adaptive_seconds, "global": run(GLOBAL)[0],
                                                "group": run(GROUP)[0]}}


__all__ += ["parse_rate_changes", "replay_adaptive"]
