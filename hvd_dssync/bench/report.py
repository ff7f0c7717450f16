"""Turn contender records into the benchmark's summary rows, its JSON and its markdown table.

Per contender: median step time, throughput, time to the target accuracy (rank 0's model and the consensus
model, the mean of all ranks'; with repeated runs, the median and its bootstrap 95% interval), final
accuracy (of the average of all ranks' models), bytes over the bottleneck measured from the inter-rack veths' counters
(with a ring-allreduce estimate beside it), and the synchronization time as a ratio to the link-bound
limit (bytes over the busiest bottleneck direction divided by its rate).
"""
import json

import numpy as np

from ..config import SyncConfig
from ..plan import SyncPlan
from ..policy import BSP, GLOBAL, GROUP
from ..sensing import Sensed
from ..topology import Topology
from .catalog import ALONE, POSTLOCAL, dssync_arguments, higher_target, period_of

__all__ = ["summarize", "higher_target", "combine", "bootstrap_interval", "call", "estimate_bottleneck_bytes", "markdown_table", "write_json",
           "targets", "render_markdown", "PYTORCH_AVERAGERS"]


def _ring_crossings(group, rack_of):
    """Ring edges of ``group`` (in rank order) that cross from one rack to another, by direction."""
    ranks = sorted(group)
    out = {}
    for a, b in zip(ranks, ranks[1:] + ranks[:1]):
        if len(ranks) > 1 and rack_of[a] != rack_of[b]:
            key = (rack_of[a], rack_of[b])
            out[key] = out.get(key, 0) + 1
    return out


def _groups_per_step(contender, steps, racks, config, sensed=None):
    """The groups each step averages over, or ``None`` for a step with no averaging."""
    size = sum(len(r) for r in racks)
    world = tuple(range(size))
    if contender in ("horovod-bsp", "ddp"):
        return [[world]] * steps
    if contender == ALONE:
        return [None] * steps
    if contender == "horovod-hierarchical":
        # Open MPI's coll/han: inside each host (no rack link crossed), then between one rank per host.
        return [[tuple(range(0, size, config.get("slots_per_host", 1)))]] * steps
    if contender.startswith("postlocal-"):
        period, warmup = period_of(contender, config), config.get("warmup_steps", 0)
        out = []
        for step in range(1, steps + 1):
            if step <= warmup:
                out.append([world])
            elif contender.startswith("postlocal-periodic"):
                out.append([world] if (step - warmup) % period == 0 else None)
            elif (step - warmup) % (period * 2) == 0:
                out.append([world])
            elif len(racks) > 1 and (step - warmup) % max(1, period // 2) == 0:
                out.append([tuple(r) for r in racks])
            else:
                out.append(None)
        return out
    if sensed:  # the default (dssync-default): resolved from what it sensed, as its optimizer resolved it
        found = Sensed(sensed["how"], sensed["racks"], hosts=sensed.get("hosts", 1))
        resolved, _ = SyncConfig(topology="auto").resolve(lambda *a: (found.topology(), found), lambda t: t)
        arguments = {k: v for k, v in resolved.plan_arguments().items() if k not in ("seed", "warmup_steps")}
    else:
        arguments = dssync_arguments(contender, dict(config, racks=racks))
    if isinstance(arguments.get("topology"), list):
        arguments["topology"] = Topology.from_racks(arguments["topology"])
    # Every rank's plan, as the optimizers build them: a step's groups are those its ranks average in.
    plans = [SyncPlan(rank, size, seed=config["seed"], warmup_steps=config.get("warmup_steps", 0), **arguments)
             for rank in world]
    out = []
    for step in range(steps):
        actions = [plan.action(step) for plan in plans]
        if actions[0].kind == GROUP:
            out.append(sorted({a.group for a in actions}))
        else:
            out.append([world] if actions[0].kind in (BSP, GLOBAL) else None)
    return out


def _binomial_crossings(group, rack_of):
    """Edges of a binomial reduce to ``group``'s first rank (the same tree broadcasts back) that cross
    from one rack to another, by direction: each carries the whole model once each way."""
    ranks = sorted(group)
    out = {}
    for j in range(1, len(ranks)):
        child, parent = ranks[j], ranks[j & (j - 1)]
        if rack_of[child] != rack_of[parent]:
            for key in ((rack_of[child], rack_of[parent]), (rack_of[parent], rack_of[child])):
                out[key] = out.get(key, 0) + 1
    return out


def estimate_bottleneck_bytes(contender, steps, racks, model_bytes, config, sensed=None):
    """Ring-allreduce estimate of the bytes over the busiest inter-rack direction (steps only);
    ``sensed``: what the default schedule sensed (dssync-default's record), which decides its groups.
    ``horovod-hierarchical``: Open MPI's coll/han with its simple allreduce, whose allreduce between one
    rank per host is a binomial reduce and broadcast (libnbc, in place), not a ring."""
    rack_of = {r: k for k, rack in enumerate(racks) for r in rack}
    per_direction = {}
    for groups in _groups_per_step(contender, steps, racks, config, sensed):
        for group in groups or ():
            n = len(group)
            if contender == "horovod-hierarchical":
                for key, edges in _binomial_crossings(group, rack_of).items():
                    per_direction[key] = per_direction.get(key, 0.0) + edges * model_bytes
                continue
            for key, edges in _ring_crossings(group, rack_of).items():
                per_direction[key] = per_direction.get(key, 0.0) + edges * 2 * (n - 1) / n * model_bytes
    return max(per_direction.values(), default=0.0)


def time_to_target(curve, target, key="accuracy"):
    """The soonest training time at which ``key`` (rank 0's ``"accuracy"``, or ``"consensus_accuracy"``) of a
    point of ``curve`` reached ``target``: the point's ``key + "_time"`` (later than its copy's ``time`` where an
    average in flight was folded into it), else its ``time``; None where none did.

    Example::

        >>> curve = [{"time": 1.0, "accuracy": 0.9}, {"time": 2.0, "accuracy": 0.96, "accuracy_time": 3.5},
        ...          {"time": 3.0, "accuracy": 0.97, "accuracy_time": 3.0}]
        >>> time_to_target(curve, 0.95), time_to_target(curve, 0.99)
        (3.0, None)
    """
    times = [point.get(f"{key}_time", point["time"]) for point in curve
             if point.get(key) is not None and point[key] >= target]
    return min(times, default=None)


def summarize(record, scenario, config):
    """One summary row from rank 0's record of one contender in one scenario."""
    steps = record["steps"]
    sensed = record.get("sensed")
    median = float(np.median(record["step_times"])) if steps else float("nan")
    samples = record["batch"] * record["size"]
    row = {
        "scenario": scenario["name"], "contender": record["contender"], "steps": steps,
        "median_step_s": median, "mean_step_s": float(np.mean(record["step_times"])) if steps else float("nan"),
        "throughput_samples_s": samples / median if median else float("nan"),
        "train_seconds": record["train_seconds"], "time_to_target_s": time_to_target(record["curve"], config["target"]),
        "time_to_higher_target_s": time_to_target(record["curve"], higher_target(config)),
        "time_to_target_consensus_s": time_to_target(record["curve"], config["target"], "consensus_accuracy"),
        "time_to_higher_target_consensus_s": time_to_target(record["curve"], higher_target(config),
                                                            "consensus_accuracy"),
        "final_accuracy": record["final_accuracy"], "rank0_accuracy": record["local_accuracy"],
        "sync_seconds": float(np.sum(record["sync_times"])), "compute_s_per_step": record["compute_seconds"],
        "bottleneck_bytes": None, "bottleneck_bytes_estimate": estimate_bottleneck_bytes(
            record["contender"], steps, config["racks"], record["model_bytes"], config, sensed),
        "link_bound_s": None, "sync_to_link_bound": None,
    }
    if record.get("cores_busy") is not None:
        row["cores_busy"] = record["cores_busy"]  # this host's, while training (hvd_dssync.bench.marks)
    if sensed is not None:
        row["sensed"] = sensed
    if record.get("overlap") is not None:
        row["overlap"] = record["overlap"]  # what the default's trial decided (hvd_dssync.overlap)
    trial = record.get("trial_steps")
    if trial and trial < steps:  # the steps after the trial: what a long job's steps cost
        row["trial_steps"] = trial
        row["mean_step_after_trial_s"] = float(np.mean(record["step_times"][trial:]))
    links = record.get("links")
    if links and links["total"]:
        row["bottleneck_bytes"] = max(links["total"].values(), default=0)
        rates = [scenario["inter_mbit"]] + [change["mbit"] for change in record.get("rate_changes", [])]
        bound = 0.0
        for phase, mbit in zip(links["phases"], rates):
            if mbit:
                bound += max(phase["bytes"].values(), default=0) * 8 / (mbit * 1e6)
        if bound > 0:
            row["link_bound_s"] = bound
            row["sync_to_link_bound"] = row["sync_seconds"] / bound
    return row


def _median_of(values):
    """The median of figures that may be ``None`` (never reached, not measured: counted as +inf, so a
    median that lands on one is ``None``)."""
    if all(v is None for v in values):
        return None
    median = float(np.median([np.inf if v is None else v for v in values]))
    return None if not np.isfinite(median) else median


_MEDIANS = ("median_step_s", "mean_step_s", "mean_step_after_trial_s", "trial_steps", "throughput_samples_s",
            "train_seconds", "time_to_target_s", "time_to_higher_target_s", "time_to_target_consensus_s",
            "time_to_higher_target_consensus_s", "final_accuracy", "rank0_accuracy", "sync_seconds",
            "compute_s_per_step", "bottleneck_bytes", "bottleneck_bytes_estimate", "link_bound_s", "sync_to_link_bound",
            "cores_busy")


def combine(rows):
    """One row per scenario and contender from the rows of repeated runs: each figure the median over the
    runs (time to target: a run that never reached it counts as never), ``times_to_target`` every run's,
    ``runs`` their number and ``median_run`` the index (among that contender's runs, in order) of the run
    whose time to target is the median one (the lower of the middle two), whose curves the plots draw.

    Example::

        >>> rows = [{"scenario": "static", "contender": "x", "steps": s, "time_to_target_s": t, "median_step_s": 0.1,
        ...          "train_seconds": 9.0, "final_accuracy": 0.97} for s, t in ((90, 3.0), (80, None), (85, 2.0))]
        >>> row = combine(rows)[0]
        >>> row["time_to_target_s"], row["times_to_target"], row["runs"], row["median_run"], row["steps"]
        (3.0, [3.0, None, 2.0], 3, 0, 85)
    """
    grouped = {}
    for row in rows:
        grouped.setdefault((row["scenario"], row["contender"]), []).append(row)
    out = []
    for runs in grouped.values():
        times = [r["time_to_target_s"] for r in runs]
        order = sorted(range(len(runs)), key=lambda i: (times[i] is None, times[i] or 0.0))
        row = dict(runs[0], runs=len(runs), times_to_target=times, median_run=order[(len(runs) - 1) // 2])
        for key in _MEDIANS:
            if key in row:
                row[key] = _median_of([r.get(key) for r in runs])
        row["steps"] = int(np.median([r["steps"] for r in runs]))
        for key in ("time_to_target_s", "time_to_higher_target_s", "time_to_target_consensus_s"):
            row[key[:-2] + "_interval"] = bootstrap_interval([r.get(key) for r in runs])
        out.append(row)
    return out


def bootstrap_interval(values, rounds=4000, seed=0):
    """The bootstrap 95% interval of the median of ``values`` (``None``: never reached, counted as +inf, and
    an end at +inf is ``None``); ``None`` for fewer than 2 values. Seeded: the same values give the same
    interval.

    Example::

        >>> bootstrap_interval([2.0, 2.2, 2.4, 2.5, 3.1])
        [2.0, 3.1]
        >>> bootstrap_interval([2.0, None, None])
        [2.0, None]
    """
    if len(values) < 2:
        return None
    data = np.array([np.inf if v is None else v for v in values], dtype=float)
    samples = np.random.default_rng(seed).choice(data, size=(rounds, len(data)), replace=True)
    medians = np.sort(np.median(samples, axis=1))
    low, high = medians[int(0.025 * (rounds - 1))], medians[int(np.ceil(0.975 * (rounds - 1)))]
    return [None if not np.isfinite(v) else float(v) for v in (low, high)]


def call(row, other, key="time_to_target_s"):
    """"sooner", "later" or "even": ``row``'s median time against ``other``'s, even where their bootstrap
    intervals overlap; ``None`` where either has no interval (a single run: no call can be made).

    Example::

        >>> call({"time_to_target_s": 2.0, "time_to_target_interval": [1.8, 2.3]},
        ...      {"time_to_target_s": 2.6, "time_to_target_interval": [2.2, 3.0]})
        'even'
        >>> call({"time_to_target_s": 2.0}, {"time_to_target_s": None}) is None
        True
    """
    mine, theirs = row.get(key[:-2] + "_interval"), other.get(key[:-2] + "_interval")
    if not mine or not theirs:
        return None
    inf = float("inf")
    low, high = (inf if v is None else v for v in mine)
    other_low, other_high = (inf if v is None else v for v in theirs)
    if high < other_low:
        return "sooner"
    if other_high < low:
        return "later"
    return "even"


def _fmt(value, spec, none="-"):
    return none if value is None else format(value, spec)


def _seconds_to_target(row):
    """Time to the target as a sentence reads it: "2.7 s [2.5, 3.0]", or "never"."""
    seconds = row["time_to_target_s"]
    return ("never" if seconds is None else f"{seconds:.1f} s") + _interval_cell(row, "time_to_target_s")


def _interval_cell(row, key):
    interval = row.get(key[:-2] + "_interval")
    if not interval:
        return ""
    return " [" + ", ".join(_fmt(v, ".1f", "never") for v in interval) + "]"


def _time_cell(row):
    """Time to target; with repeated runs, the median, its bootstrap interval and every run's time."""
    cell = _fmt(row["time_to_target_s"], ".1f", "not reached") + _interval_cell(row, "time_to_target_s")
    if row.get("runs", 1) > 1:
        cell += " (" + ", ".join(_fmt(t, ".1f", "never") for t in row["times_to_target"]) + ")"
    return cell


def markdown_table(rows, target):
    """The summary as a markdown table, one line per scenario and contender (with repeated runs, the
    medians of :func:`combine`, and every run's time to target; the time to the higher target, a median)."""
    repeated = any(r.get("runs", 1) > 1 for r in rows)
    higher = higher_target({"target": target})
    head = ("| scenario | contender | steps | median step (s) | samples/s | time to "
            f"{target:.0%} (s){', median [95% interval] (each run)' if repeated else ''} | consensus to "
            f"{target:.0%} (s) | time to {higher:.0%} (s) | final acc. | MB over bottleneck (est.) | sync / link-bound |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        mb = "-" if r["bottleneck_bytes"] is None else f"{r['bottleneck_bytes'] / 1e6:.1f}"
        lines.append(
            f"| {r['scenario']} | {r['contender']} | {r['steps']} | {r['median_step_s']:.3f} | "
            f"{r['throughput_samples_s']:.0f} | {_time_cell(r)} | "
            f"{_fmt(r.get('time_to_target_consensus_s'), '.1f', 'not reached')}"
            f"{_interval_cell(r, 'time_to_target_consensus_s')} | "
            f"{_fmt(r.get('time_to_higher_target_s'), '.1f', 'not reached')}"
            f"{_interval_cell(r, 'time_to_higher_target_s')} | {r['final_accuracy']:.1%} | "
            f"{mb} ({r['bottleneck_bytes_estimate'] / 1e6:.1f}) | "
            f"{_fmt(r['sync_to_link_bound'], '.2f')} |")
    return "\n".join(lines) + "\n"


PYTORCH_AVERAGERS = POSTLOCAL
ADAPTIVE = "dssync-adaptive"


def _is_dssync(contender):
    return contender.startswith("dssync-")


def _best(rows):
    """The row that reached the target first; if none did, the one whose budget bounds a speedup least."""
    return min(rows, key=lambda r: (r["time_to_target_s"] is None, r["time_to_target_s"] or r["train_seconds"]),
               default=None)


def _sooner(row, reference, factor, missing):
    """``(met, figures)`` for "``row`` reaches the target at least ``factor`` times sooner than ``reference``".

    A reference that never reached the target bounds the speedup from below by its training budget
    over ``row``'s time: met if that bound is already ``factor``, else not shown (``None``). ``missing``
    names the reference where it did not run.
    """
    t = row["time_to_target_s"]
    if reference is None:
        return None, f"no {missing} ran"
    t_ref, name = reference["time_to_target_s"], reference["contender"]
    if t is None:
        return False, f"never vs {name} " + ("never" if t_ref is None else f"{t_ref:.1f} s")
    if t_ref is None:
        bound = reference["train_seconds"] / t
        return (True if bound >= factor else None), \
            f"{t:.1f} s vs {name} never in {reference['train_seconds']:.1f} s (> {bound:.2f}x, need {factor:g}x)"
    return t_ref / t >= factor, f"{t:.1f} s vs {name} {t_ref:.1f} s ({t_ref / t:.2f}x, need {factor:g}x)"


def _adaptive_target(scenario, adaptive, fixed):
    """The adaptive policy against the fixed choices that ran: within 10% of the best of them, chosen in
    hindsight; where the network changes twice (``recover``), sooner than every one of them."""
    best = _best(fixed)
    t, t_best = adaptive["time_to_target_s"], best["time_to_target_s"]
    if scenario == "recover":
        what = "reaches the target sooner than every fixed choice"
        met = t is not None and all(r["time_to_target_s"] is None or t < r["time_to_target_s"] for r in fixed)
    else:
        what = "reaches the target within 10% of the time of the best fixed choice"
        met = t is not None and (t_best is None or t <= 1.1 * t_best)
    figures = ("never" if t is None else f"{t:.1f} s") + f" vs {best['contender']} " + \
        ("never" if t_best is None else f"{t_best:.1f} s")
    return f"{scenario}: {adaptive['contender']} {what}", met, figures


def _mean_step(row):
    return row["train_seconds"] / row["steps"] if row["steps"] else float("inf")


def _all(*mets):
    """True if every part is met, False if one is missed, else None (not shown)."""
    return False if False in mets else None if None in mets else True


def targets(rows):
    """The targets, checked for each DS-Sync contender on its own: a list of (target, met or None, figures).

    - static and bandwidth: the target accuracy at least 1.5x sooner than the best PyTorch averager and
      3x sooner than Horovod BSP, final accuracy at most 0.5 pp below BSP's;
    - stragglers: at least 1.5x sooner than the best contender that is not DS-Sync;
    - none: mean step (training time over steps) not slower than Horovod BSP's;
    - static: synchronization time within 1.25x of the link-bound limit;
    - where the adaptive policy ran: the target within 10% of the time of the best fixed choice (Horovod
      BSP or a fixed DS-Sync contender), chosen in hindsight; in ``recover``, sooner than every one.
    """
    out = []
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    for scenario in scenarios:
        here = [r for r in rows if r["scenario"] == scenario]
        bsp = next((r for r in here if r["contender"] == "horovod-bsp"), None)
        dssync = [r for r in here if _is_dssync(r["contender"])]
        if scenario in ("static", "bandwidth"):
            averagers = [r for r in here if r["contender"] in PYTORCH_AVERAGERS]
            averager = _best(averagers)
            # Says which averagers ran: "the best" is of those alone, never of the grid's other periods.
            ran = ", ".join(r["contender"] for r in averagers) or "none"
            for row in dssync:
                met_avg, fig_avg = _sooner(row, averager, 1.5, "PyTorch averager")
                met_bsp, fig_bsp = _sooner(row, bsp, 3.0, "Horovod BSP")
                if bsp is None:
                    met_acc, fig_acc = None, "final accuracy: no Horovod BSP ran"
                else:
                    gap = (bsp["final_accuracy"] - row["final_accuracy"]) * 100
                    # One-sided: DS-Sync may lose at most 0.5 pp; ending higher is no miss.
                    met_acc = gap <= 0.5
                    fig_acc = f"final accuracy {row['final_accuracy']:.1%} vs BSP {bsp['final_accuracy']:.1%}"
                out.append((f"{scenario}: {row['contender']} reaches the target >= 1.5x sooner than the best PyTorch "
                            f"averager that ran ({ran}) and >= 3x sooner than Horovod BSP, final accuracy at most "
                            "0.5 pp below BSP's",
                            _all(met_avg, met_bsp, met_acc), f"{fig_avg}; {fig_bsp}; {fig_acc}"))
        elif scenario == "stragglers":
            other = _best([r for r in here if not _is_dssync(r["contender"])])
            for row in dssync:
                met, figures = _sooner(row, other, 1.5, "contender other than DS-Sync")
                out.append((f"{scenario}: {row['contender']} reaches the target >= 1.5x sooner than the best "
                            "contender that is not DS-Sync", met, figures))
        elif scenario == "none" and bsp is not None:
            # The mean, not the median: the median step of a contender with local steps is a step
            # that does not communicate.
            for row in dssync:
                out.append((f"{scenario}: {row['contender']} not slower per step than Horovod BSP",
                            _mean_step(row) <= _mean_step(bsp),
                            f"mean step {_mean_step(row):.3f} s vs BSP {_mean_step(bsp):.3f} s (median "
                            f"{row['median_step_s']:.3f} s vs {bsp['median_step_s']:.3f} s)"))
        # What a user of the product could fix in advance instead of letting the adaptive policy choose.
        fixed = [r for r in here if r["contender"] == "horovod-bsp" or _is_dssync(r["contender"])
                 and not r["contender"].startswith(ADAPTIVE)]
        for adaptive in (r for r in here if r["contender"].startswith(ADAPTIVE)):
            if fixed:
                out.append(_adaptive_target(scenario, adaptive, fixed))
        if scenario == "static":
            for row in dssync:
                if row["sync_to_link_bound"]:
                    out.append((f"{scenario}: {row['contender']}'s synchronization time within 1.25x of the "
                                "link-bound limit", row["sync_to_link_bound"] <= 1.25,
                                f"{row['sync_to_link_bound']:.2f}x"))
    return out


def calls(rows):
    """Every DS-Sync contender against the best PyTorch averager and Horovod BSP of its scenario, to the target
    (rank 0's model): sooner, later, or even where the bootstrap intervals overlap; the figures alone after a
    single run."""
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        here = [r for r in rows if r["scenario"] == scenario]
        others = [_best([r for r in here if r["contender"] in PYTORCH_AVERAGERS]),
                  next((r for r in here if r["contender"] == "horovod-bsp"), None)]
        for row in (r for r in here if _is_dssync(r["contender"])):
            for other in (o for o in others if o is not None):
                verdict = call(row, other)
                figures = f"{_seconds_to_target(row)} vs {_seconds_to_target(other)}"
                if verdict is None:  # one run each: no interval, no call
                    out.append(f"- {scenario}: {row['contender']} against {other['contender']}: {figures} "
                               "(one run: --repeat 2 or more for a call)")
                else:
                    out.append(f"- {scenario}: {row['contender']} is {verdict.upper()} against "
                               f"{other['contender']} ({figures})")
    return out


def write_json(path, payload):
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)


def render_markdown(payload):
    """results.md from a bench payload (``results.json``): the table of :func:`markdown_table` and every
    target of :func:`targets`, checked again on the payload's rows."""
    rows = payload["rows"]
    lines = [markdown_table(rows, payload["config"]["target"]), ""]
    if payload.get("repeat", 1) > 1:
        lines += [f"Targets judged on the medians of {payload['repeat']} runs each.", ""]
    for t, m, f in targets(rows):
        lines.append(f"- {'MET' if m else 'NOT SHOWN' if m is None else 'MISSED'}: {t}: {f}")
    lines += [""] + calls(rows)
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        busy = [f"{r['contender']} {100 * r['cores_busy']:.0f}%" for r in rows
                if r["scenario"] == scenario and r.get("cores_busy") is not None]
        if busy:
            lines.append(f"- this host's cores busy while training ({scenario}): " + ", ".join(busy))
    for r in rows:
        if r.get("sensed"):
            s = r["sensed"]
            lines.append(f"- sensed ({r['scenario']}, {r['contender']}): {s['found']} {s['racks'] or ''} by "
                         f"{s['how']} ({s['hosts']} hosts, {s['pairs']} pairs timed"
                         + (f", {s['reading']}" if s.get("reading") else "") + f") in {s['seconds']:.2f} s")
        if r.get("mean_step_after_trial_s") is not None:
            lines.append(f"- the trial of overlap ({r['scenario']}, {r['contender']}): decided after "
                         f"{r['trial_steps']:.0f} steps; the mean step after it {r['mean_step_after_trial_s']:.3f} s, "
                         f"over the run {r['mean_step_s']:.3f} s")
    return "\n".join(lines) + "\n"
