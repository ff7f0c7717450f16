"""The simulator's table: every contender at every world size, mixing and link figures side by side."""
import math

import numpy as np

from ..schedules import Butterfly, Shuffle, TopologyAware, _check_int
from .links import _Links, rack_topology, schedule_link_loads
from .mixing import _default_period, consensus_error, spectral_gap, steps_to_error
from .partitions import _as_arrays

__all__ = ["TABLE_SCHEDULES", "table_schedules", "simulate_table", "format_table"]

TABLE_SCHEDULES = ("bsp", "shuffle", "butterfly", "topology")


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
