"""The longest single step of DS-Sync's runs through a real launcher, against the median of its averaging steps.

Each run is one bench job (``python -m hvd_dssync bench``, static scenario, one contender) on the emulated
cluster with several ranks per host, launched as on a cluster (``--launcher mpirun`` or ``horovodrun``). A
run passes when no step, local or not, takes longer than ``--bound`` (10) times the median of the same run's
averaging steps (every step whose kind is not ``local``). Run as root from the repository root::

    .venv/bin/python -m hvd_dssync.bench.experiments.long_steps --launcher mpirun --layouts 2x4,4x2 --runs 5

``HOROVOD_*`` variables set here reach every rank (``HOROVOD_MPI_SLEEPING_WAITS=0``: the build's sleeping MPI
waits off, for a side-by-side run). Each job runs once under a timeout; a failed job is reported as such and
counts as a failed run. Exits 0 when every run passed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def longest_step(record):
    """``(longest step, its kind, median averaging step, steps)`` of a bench record (rank 0's)."""
    times, kinds = record["step_times"], record.get("kind_of_step") or []
    averaging = [t for t, kind in zip(times, kinds) if kind != "local"] or list(times)
    at = max(range(len(times)), key=times.__getitem__)
    return times[at], (kinds[at] if at < len(kinds) else "?"), statistics.median(averaging), len(times)


def run_once(layout, args, out):
    """One bench job with ``layout`` = (hosts, slots); returns rank 0's record of the contender, or raises."""
    hosts, slots = layout
    argv = [sys.executable, "-m", "hvd_dssync", "bench", "--ranks", str(hosts * slots), "--racks", str(args.racks),
            "--slots-per-host", str(slots), "--launcher", args.launcher, "--scenarios", "static",
            "--contenders", args.contender, "--steps", str(args.steps), "--max-train-seconds", str(args.seconds),
            "--timeout", str(args.timeout), "--seed", str(args.seed), "--no-plots", "--out", out]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout + 120)
    path = os.path.join(out, "results.json")
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"bench exited {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}")
    with open(path) as f:
        payload = json.load(f)
    records = [run["record"] for run in payload["runs"] if run["contender"] == args.contender]
    if not records or "step_times" not in records[0]:
        raise RuntimeError(f"no record of {args.contender}: {payload.get('failures')}")
    return records[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launcher", choices=("mpirun", "horovodrun"), default="mpirun")
    p.add_argument("--layouts", default="2x4,4x2", help="HOSTSxSLOTS, comma-separated")
    p.add_argument("--racks", type=int, default=2)
    p.add_argument("--runs", type=int, default=5, help="runs per layout")
    p.add_argument("--contender", default="dssync-default")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seconds", type=float, default=12.0, help="training-time budget per run")
    p.add_argument("--timeout", type=float, default=200.0, help="seconds before a job is killed")
    p.add_argument("--bound", type=float, default=10.0, help="longest step allowed, in median averaging steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    layouts = [tuple(int(n) for n in text.split("x")) for text in args.layouts.split(",")]
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")) or "none"
    print(f"{args.contender} under {args.launcher}, static scenario, {args.seconds:g} s budget; Horovod settings: "
          f"{settings}")
    print("| layout | run | steps | longest step (kind) | median averaging step | ratio | within bound |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for hosts, slots in layouts:
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="hvd_dssync-long-steps-") as out:
                try:
                    longest, kind, median, steps = longest_step(run_once((hosts, slots), args, out))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    failed += 1
                    print(f"| {hosts} hosts of {slots} | {run + 1} | job failed: {str(e).splitlines()[0][:80]} "
                          "| | | no |", flush=True)
                    continue
            ratio = longest / median if median > 0 else float("inf")
            ok = ratio <= args.bound
            failed += not ok
            print(f"| {hosts} hosts of {slots} | {run + 1} | {steps} | {longest:.2f} s ({kind}) | {median:.3f} s "
                  f"| {ratio:.1f}x | {'yes' if ok else 'NO'} |", flush=True)
    total = len(layouts) * args.runs
    print(f"\n{total - failed} of {total} runs within {args.bound:g}x the median averaging step")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
