"""Replay a network whose rates change over time under the adaptive policy, and under each fixed mode."""
import json
import os

from ..adaptive import AdaptivePolicy, AdaptiveState
from ..plan import first_crossing
from ..policy import GLOBAL, GROUP
from ..schedules import TopologyAware, _check_int, canonical_partition
from .links import _Links, rack_topology
from .partitions import _as_arrays, _check_positive

__all__ = ["parse_rate_changes", "replay_adaptive"]


def parse_rate_changes(text):
    """Link rates over (simulated) time: ``"t=30:inter=4,t=60:inter=40"`` or the path of a JSON timetable.

    Each change names a time ``t`` in seconds and new rates in Gb/s: ``inter`` (the rack uplinks) and/or
    ``intra`` (the host NICs). A JSON timetable is a list of objects with the same keys. Returns the
    changes as ``[(t, {"inter": ..., "intra": ...}), ...]`` sorted by time.

    Example::

        >>> parse_rate_changes("t=60:inter=40,t=30:inter=4:intra=5")
        [(30.0, {'inter': 4.0, 'intra': 5.0}), (60.0, {'inter': 40.0})]
    """
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
