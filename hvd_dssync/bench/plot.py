"""``python -m hvd_dssync plot results.json [--out DIR]``: the benchmark's PNG plots.

- ``loss_accuracy_<scenario>.png``: training loss and test accuracy (rank 0's model) against training time;
- ``time_to_accuracy.png``: time to the target accuracy per contender and scenario.
"""
import argparse
import json
import os

__all__ = ["main", "plot_results"]


def plot_results(payload, out_dir):
    """Write the plots of a results payload into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    target = payload["config"]["target"]
    paths = []
    scenarios = []
    for run in payload["runs"]:
        if run["scenario"] not in scenarios:
            scenarios.append(run["scenario"])
    for scenario in scenarios:
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
        for run in payload["runs"]:
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
    return paths


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
