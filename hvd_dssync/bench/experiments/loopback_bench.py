"""Per-step cost of DS-Sync against hvd.DistributedOptimizer on loopback, per launcher.

Runs examples/pytorch_synthetic_benchmark.py under each launcher (the test suite's settings: Open MPI
yielding when idle, OMP_NUM_THREADS=1) for Horovod's optimizer and DS-Sync variants, one after the
other in one run, and prints a markdown table of median step times and their ratio to Horovod's::

    .venv/bin/python hvd_dssync/bench/experiments/loopback_bench.py --np 4 --params 1
"""
import argparse
import json
import os
import sys
import tempfile

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(_CHECKOUT, "tests"))
from multirank import LAUNCHERS, ROOT, run  # noqa: E402

VARIANTS = {
    "horovod": [],
    "dssync shuffle (plain hvd.init, dynamic sets)": ["--dssync"],
    "dssync shuffle (dss.init, static sets)": ["--dssync", "--static"],
    "dssync butterfly (dss.init, static sets)": ["--dssync", "--schedule", "butterfly", "--static"],
    "dssync shuffle overlap (dynamic sets)": ["--dssync", "--overlap"],
    "dssync shuffle overlap (dss.init, static sets)": ["--dssync", "--overlap", "--static"],
    "dssync shuffle, average_every=4 (dss.init, static sets)": ["--dssync", "--static", "--average-every", "4"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--params", type=float, default=1.0, help="model size, millions of parameters")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--model", default="mlp", choices=("mlp", "resnet18"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--variants", default=",".join(str(i) for i in range(len(VARIANTS))),
                        help="indices of the variants to run, comma separated (0 is Horovod, the reference)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for launcher in args.launchers.split(","):
            out = os.path.join(tmp, f"{launcher}.jsonl")
            chosen = [list(VARIANTS)[int(i)] for i in args.variants.split(",")]
            for label in chosen:
                run(launcher, args.np, f"{ROOT}/examples/pytorch_synthetic_benchmark.py", *VARIANTS[label],
                    "--params", args.params, "--model", args.model, "--batch-size", args.batch_size,
                    "--json", out, timeout=600)
            results = [json.loads(line) for line in open(out)]
            base = results[0]["slowest_rank_step_ms"]
            for label, result in zip(chosen, results):
                rows.append((launcher, label, result["slowest_rank_step_ms"], result["slowest_rank_step_ms"] / base))
    size = f"{args.params}M-parameter MLP" if args.model == "mlp" else "ResNet-18 (11.2M parameters, 32x32)"
    print(f"\n{args.np} ranks, {size}, batch {args.batch_size}, loopback\n")
    print("| launcher | optimizer | median step (ms, slowest rank) | vs Horovod |")
    print("| --- | --- | ---: | ---: |")
    for launcher, label, ms, ratio in rows:
        print(f"| {launcher} | {label} | {ms:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
