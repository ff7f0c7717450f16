"""``python -m hvd_dssync plot results.json [--out DIR]``: the benchmark's PNG plots.

- ``loss_accuracy_<scenario>.png``: training loss and test accuracy (rank 0's model) against training time;
- ``time_to_accuracy.png``: time to the target accuracy per contender and scenario (with repeated runs, the
  median as a bar and every run as a dot);

With repeated runs, the curves are those of each contender's median run (see
:func:`hvd_dssync.bench.report.combine`).
- ``decisions_<scenario>.png``: for each contender with ``policy="adaptive"``, every averaging step's seconds
  (rank 0) by kind against training time, and the policy's decisions that changed something.
"""
import argparse
import json
import os

__all__ = ["main", "plot_results"]


def _median_runs(payload):
    """The runs whose curves the plots draw: with repeated runs, each contender's median run."""
    chosen = {(r["scenario"], r["contender"]): r.get("median_run", 0) for r in payload["rows"]}
    seen, out = {}, []
    for run in payload["runs"]:
        key = (run["scenario"], run["contender"])
        index = seen[key] = seen.get(key, -1) + 1
        if index == chosen.get(key, 0):
            out.append(run)
    return out


def plot_results(payload, out_dir):
    """Write the plots of a results payload into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    target = payload["config"]["target"]
    paths = []
    scenarios = []
    runs = _median_runs(payload)
    for run in runs:
        if run["scenario"] not in scenarios:
            scenarios.append(run["scenario"])
    for scenario in scenarios:
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
        for run in runs:
            if run["scenario"] != scenario:
                continue
            curve = run["record"]["curve"]
            t = [p["time"] for p in curve]
            ax_loss.plot(t, [p["train_loss"] for p in curve], label=run["contender"])
            ax_acc.plot(t, [p["accuracy"] for p in curve], label=run["contender"])
        ax_loss.set(xlabel="training time (s)", ylabel="training loss", yscale="log", title=f"{scenario}: loss")
        ax_acc.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax_acc.set(xlabel="training time (s)", ylabel="test accuracy (rank 0's model)", ylim=(0, 1),
                   title=f"{scenario}: accuracy")
        ax_acc.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = os.path.join(out_dir, f"loss_accuracy_{scenario}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    rows = payload["rows"]
    if rows:
        fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows)), 4))
        labels = [f"{r['scenario']}\n{r['contender']}" for r in rows]
        budget = max((r["train_seconds"] for r in rows), default=1.0)
        values = [r["time_to_target_s"] if r["time_to_target_s"] is not None else budget for r in rows]
        colors = ["tab:blue" if r["time_to_target_s"] is not None else "lightgrey" for r in rows]
        ax.bar(range(len(rows)), values, color=colors)
        for i, r in enumerate(rows):
            if r.get("runs", 1) > 1:
                each = [budget if t is None else t for t in r["times_to_target"]]
                ax.scatter([i] * len(each), each, s=10, color="black", zorder=3)
        for i, r in enumerate(rows):
            if r["time_to_target_s"] is None:
                ax.text(i, values[i], "not\nreached", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set(ylabel=f"time to {target:.0%} test accuracy (s)", title="time to accuracy")
        fig.tight_layout()
        path = os.path.join(out_dir, "time_to_accuracy.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    for scenario in scenarios:
        adaptive = [run for run in runs if run["scenario"] == scenario and run["record"].get("decisions")]
        if adaptive:
            paths.append(_plot_decisions(plt, scenario, adaptive, out_dir))
    return paths


_COLORS = {"global": "tab:red", "group": "tab:blue", "bsp": "tab:purple"}


def _plot_decisions(plt, scenario, runs, out_dir):
    """One panel per adaptive contender: what each averaging step cost, by kind, and the decisions."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.8 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        record, clock = run["record"], 0.0
        points = {}
        for elapsed, seconds, kind in zip(record["step_times"], record["sync_times"], record["kind_of_step"]):
            clock += elapsed
            if kind in _COLORS:
                points.setdefault(kind, ([], []))
                points[kind][0].append(clock)
                points[kind][1].append(seconds)
        for kind, (t, seconds) in points.items():
            ax.scatter(t, seconds, s=8, color=_COLORS[kind], label=f"{kind} average")
        previous = ("global", None)
        for decision in record["decisions"]:
            now = (decision["mode"], decision["period"])
            if now != previous or decision.get("sync_now"):
                ax.axvline(decision["time"], color="grey", linestyle="--", linewidth=0.8)
                label = f"{decision['mode']}, every {decision['period']}" + (", sync" if decision.get("sync_now") else "")
                ax.text(decision["time"], ax.get_ylim()[1] * 0.95, label, rotation=90, fontsize=6, va="top")
            previous = now
        ax.set(xlabel="training time (s)", ylabel="seconds (rank 0)", title=f"{scenario}: {run['contender']}")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path = os.path.join(out_dir, f"decisions_{scenario}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hvd_dssync plot", description=__doc__.split("\n")[0])
    parser.add_argument("results", help="results.json written by `python -m hvd_dssync bench`")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: the results' folder)")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        payload = json.load(f)
    for path in plot_results(payload, args.out or os.path.dirname(os.path.abspath(args.results))):
        print(path)
    return 0
