"""The click-model benchmark (examples/pytorch_sparse_benchmark.py, or with ``--framework keras`` its Keras
twin) on the emulated bottlenecked cluster.

Each variant is its own job on one testbed (hvd_dssync.bench.testbed: a network namespace per rank, racks
joined by a shaped link), launched as the bench launches its Horovod contenders (Gloo controller, a
rendezvous server of the bench's), one after the other in one run. Prints the example's row of each variant
with the bytes that crossed the link between the racks::

    .venv/bin/python hvd_dssync/bench/experiments/sparse_bench.py --ranks 4 --racks 2 --intra-mbit 4000 --inter-mbit 400

Needs root and network namespaces; ``--loopback`` runs the same jobs on loopback.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from hvd_dssync.bench.contenders import ROOT, start_rendezvous, rank_env  # noqa: E402
from hvd_dssync.bench.testbed import LoopbackBed, Testbed, namespaces_available  # noqa: E402

EXAMPLES = {framework: os.path.join(ROOT, "examples", f"{framework}_sparse_benchmark.py")
            for framework in ("pytorch", "keras")}
VARIANTS = ("horovod-sparse", "horovod-sparse-as-dense", "dssync-dense", "dssync-sparse")


def run_variant(bed, example, variant, extra, timeout):
    deadline = time.monotonic() + timeout
    rendezvous, port = start_rendezvous(bed, deadline)
    before = bed.bottleneck_bytes()
    procs = []
    # Every rank's stderr, to show where a failed job failed first.
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(bed.size)]
    try:
        for rank in range(bed.size):
            argv = [sys.executable, example, "--variants", variant, *extra]
            procs.append(bed.popen(rank, argv, env=rank_env(bed, rank, "dssync-local", port),
                                   stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                   stderr=logs[rank], text=True))
        out, _ = procs[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
        for proc in procs[1:]:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        crossed = max((bed.bottleneck_bytes()[k] - before[k] for k in before), default=0)
        row = next((line for line in out.splitlines() if line.startswith(f"| {variant} |")), None)
        if row is None or any(p.returncode for p in procs):
            tails = []
            for rank, log in enumerate(logs):
                log.seek(0)
                text = log.read()
                if "Traceback" in text:
                    tails.append(f"rank {rank}:\n{text[text.index('Traceback'):][-3000:]}")
            raise RuntimeError(f"{variant} failed (exit codes {[p.returncode for p in procs]}):\n{out[-1000:]}\n"
                               + "\n".join(tails))
        return row, crossed
    finally:
        for log in logs:
            log.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        rendezvous.stdin.close()
        rendezvous.wait(timeout=5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--racks", type=int, default=2)
    parser.add_argument("--intra-mbit", type=float, default=4000.0)
    parser.add_argument("--inter-mbit", type=float, default=400.0)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before one variant's job is killed")
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--target-loss", type=float, default=None, help="passed to the example")
    parser.add_argument("--framework", choices=sorted(EXAMPLES), default="pytorch",
                        help="which adapter's click model (examples/<framework>_sparse_benchmark.py)")
    args = parser.parse_args()
    per_rack = args.ranks // args.racks
    racks = [list(range(k * per_rack, (k + 1) * per_rack)) for k in range(args.racks)]
    ok, why = (False, "--loopback given") if args.loopback else namespaces_available()
    sizes = [per_rack] * args.racks
    bed = Testbed(sizes, intra_mbit=args.intra_mbit, inter_mbit=args.inter_mbit) if ok else LoopbackBed(sizes)
    where = (f"emulated cluster: racks {racks}, hosts {args.intra_mbit:g} Mbit/s, between racks "
             f"{args.inter_mbit:g} Mbit/s" if ok else f"loopback ({why})")
    extra = ["--rows", str(args.rows), "--steps", str(args.steps)]
    if args.target_loss:
        extra += ["--target-loss", str(args.target_loss)]
    lines = []
    with bed:
        for variant in args.variants.split(","):
            print(f"  {variant} ...", flush=True)
            row, crossed = run_variant(bed, EXAMPLES[args.framework], variant, extra, args.timeout)
            lines.append(f"{row} {crossed / 1e6 / args.steps:.2f} |" if ok else f"{row} - |")
    print(f"\n{args.framework}, {args.ranks} ranks, {where}; Gloo controller, OMP_NUM_THREADS=1; {args.rows} rows, {args.steps} steps\n")
    play = "median / max" if args.framework == "pytorch" else "at the end"
    print(f"| variant | median step (ms) | MB sent per step (rank 0) | rows in play (both tables), {play} | "
          f"loss, last 10 steps | s to loss < {args.target_loss or '-'} (step) | held-out AUC | "
          "MB per step over the bottleneck |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
