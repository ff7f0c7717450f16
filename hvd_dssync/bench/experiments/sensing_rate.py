"""How often the default's sensing finds the right racks, on the bench's emulated networks.

Each run is a fresh job of one rank per emulated host that builds the one-line swap's optimizer (which
senses the racks, :mod:`hvd_dssync.sensing`) and reports what it found. A run is right where it found the
testbed's racks, or one flat network on ``none``: the link between the racks runs at one host's rate, so
the 4 hosts of a rack share it 4:1 but a lone flow sees no bottleneck, and there one flat network trained
sooner than the racks' schedule (docs/tuning.md).

    python -m hvd_dssync.bench.experiments.sensing_rate --runs 10 --networks static,bandwidth,none,sixteen

Prints one table row per network (right answers, what was found, the rule's margins, the sensing's
seconds) and, with ``--json``, every run's record.
"""
import argparse
import json
import os
import sys
from collections import Counter

from ..arguments import names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# name: (hosts per rack, host Mbit/s, Mbit/s between racks)
NETWORKS = {
    "static": ([4, 4], 400.0, 40.0),  # the bench's static scenario
    "bandwidth": ([4, 4], 4000.0, 400.0),  # the bandwidth and accelerator scenarios' network
    "none": ([4, 4], 400.0, 400.0),  # the none scenario: one flat network, 4:1 oversubscribed
    "sixteen": ([8, 8], 400.0, 40.0),  # 16 hosts, the static scenario's rates
}


def worker():
    """One rank: build the swap's optimizer (it senses) and, on rank 0, print what it found."""
    import horovod.torch as hvd
    import torch

    import hvd_dssync.torch as dss

    hvd.init()
    model = torch.nn.Linear(4, 2)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="sensing_rate.done")
    assert total.item() == hvd.size(), total
    if hvd.rank() == 0:
        print("SENSED " + json.dumps(opt.sensed), flush=True)


def run_once(racks, intra_mbit, inter_mbit, timeout):
    """One job on a fresh testbed: ``(rank 0's opt.sensed or None, the testbed's racks of ranks, what failed)``."""
    from ..contenders import run_ranks
    from ..testbed import Testbed

    with Testbed(racks=racks, intra_mbit=intra_mbit, inter_mbit=inter_mbit) as bed:
        argv = [sys.executable, "-m", "hvd_dssync.bench.experiments.sensing_rate", "--worker"]
        ranks = run_ranks(bed, argv, "dssync-default", timeout)
        true_racks = bed.rack_ranks()
    lines = [line for line in ranks[0][1].splitlines() if line.startswith("SENSED ")]
    if any(code != 0 for code, _ in ranks) or not lines:
        return None, true_racks, "\n".join(out for _, out in ranks)[-2000:]
    return json.loads(lines[0][7:]), true_racks, ""


def judge(sensed, true_racks, flat):
    """``"right"``, ``"flat"`` (one flat network where there are racks), or ``"wrong"`` (other racks, or racks
    on a flat network)."""
    if flat:
        return "right" if sensed["racks"] is None else "wrong"
    if sensed["racks"] == true_racks:
        return "right"
    return "flat" if sensed["racks"] is None else "wrong"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--networks", type=names("network", tuple(NETWORKS)), default=list(NETWORKS))
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    p.add_argument("--json", help="write every run's record here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker()
    records = []
    print("| network | hosts | Mbit/s (hosts / between racks) | right | found | margin (min-max) | seconds (median) |")
    print("|---|---:|---|---:|---|---|---:|")
    for name in args.networks:
        racks, intra, inter = NETWORKS[name]
        verdicts, found, margins, seconds = Counter(), Counter(), [], []
        for run in range(args.runs):
            sensed, true_racks, failure = run_once(racks, intra, inter, args.timeout)
            if sensed is None:
                verdicts["failed"] += 1
                print(f"{name} run {run}: failed: {failure}", file=sys.stderr)
                continue
            verdict = judge(sensed, true_racks, flat=intra == inter)
            verdicts[verdict] += 1
            found[json.dumps(sensed["racks"])] += 1
            if sensed.get("margin") is not None:
                margins.append(sensed["margin"])
            seconds.append(sensed["seconds"])
            records.append({"network": name, "run": run, "verdict": verdict, "sensed": sensed})
            print(f"{name} run {run}: {verdict}: {sensed['found']} {sensed['racks'] or ''} "
                  f"({sensed.get('reading', '')}, {sensed.get('retimed', 0)} pairs timed again) "
                  f"in {sensed['seconds']:.2f} s", file=sys.stderr, flush=True)
        right = f"{verdicts['right']} of {args.runs}"
        seen = "; ".join(f"{k} x{v}" for k, v in found.most_common())
        span = f"{min(margins):.1f}-{max(margins):.1f}x" if margins else "-"
        median = sorted(seconds)[len(seconds) // 2] if seconds else float("nan")
        print(f"| {name} | {sum(racks)} | {intra:g} / {inter:g} | {right} | {seen} | {span} | {median:.2f} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
