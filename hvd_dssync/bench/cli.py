"""``python -m hvd_dssync bench``: every contender, side by side, on one emulated cluster, in one run.

Every contender runs in every scenario (:mod:`hvd_dssync.bench.scenarios`: ``static``, ``dynamic``,
``recover``, ``bandwidth``, ``stragglers``, ``transient``, ``none``), one testbed for all, its rates set per
scenario.

By default (``--launcher bench``) every rank is an emulated host (network namespace) launched with the
Gloo controller and a rendezvous server started here. ``--launcher horovodrun`` or ``mpirun`` launches the
Horovod contenders as on a cluster instead: the launcher on the first host, the others reached through its
remote-shell setting (:mod:`hvd_dssync.bench.launchers`), ``--slots-per-host`` ranks on each host.
``horovod-hierarchical`` (Horovod's hierarchical allreduce on CPUs: Open MPI's coll/han) runs under mpirun
whatever ``--launcher`` says, on the same hosts; ``results.json`` says so (``launchers``). Without root or
network namespaces the run falls back to loopback (unshaped, one scenario, no mpirun contender) and says so.
"""
import argparse
import json
import os
import sys
import time

from . import report
from .arguments import names, positive_float
from .contenders import CONTENDERS, HOROVOD_CONTENDERS, JobFailed, run_contender
from .launchers import MPIRUN_ONLY, contender_launcher, run_launched_contender
from .metric import SNAPSHOT_BUDGET_BYTES, TASKS
from .scenarios import SCENARIOS, scenario
from .testbed import LoopbackBed, Testbed, namespaces_available

__all__ = ["main", "build_parser"]


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_dssync bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="ranks, one per emulated host")
    p.add_argument("--racks", type=int, default=2, help="racks of equal size, ranks numbered rack by rack")
    p.add_argument("--launcher", choices=("bench", "horovodrun", "mpirun"), default="bench",
                   help="bench: ranks started here with Horovod's rendezvous (every contender); horovodrun, "
                        "mpirun: the Horovod contenders launched from the first host (docs/multihost.md); "
                        "horovod-hierarchical runs under mpirun with each of them")
    p.add_argument("--slots-per-host", type=int, default=1,
                   help="ranks per emulated host (more than 1 needs --launcher horovodrun or mpirun)")
    p.add_argument("--intra-mbit", type=float, default=400.0, help="each host's own link rate")
    p.add_argument("--inter-mbit", type=float, default=40.0, help="rate between racks (static scenario)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added one-way delay between racks")
    p.add_argument("--scenarios", type=names("scenario", SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--contenders", type=names("contender", CONTENDERS), default=list(CONTENDERS),
                   help="comma-separated, or 'all'")
    p.add_argument("--others-in", type=names("contender", CONTENDERS), default=list(CONTENDERS),
                   help="of the contenders, those that also run in the scenarios other than static")
    p.add_argument("--steps", type=int, default=150, help="most training steps per contender")
    p.add_argument("--max-train-seconds", type=float, default=20.0, help="training-time budget per contender")
    p.add_argument("--dynamic-after", type=float, default=4.0, help="seconds before the dynamic rate drop")
    p.add_argument("--recover-after", type=float, default=10.0,
                   help="recover scenario: seconds before the rate between racks is back to the hosts' rate")
    p.add_argument("--hidden", type=int, default=512, help="MLP width (parameters ~ hidden^2)")
    p.add_argument("--bandwidth-hidden", type=int, default=2400,
                   help="MLP width in the bandwidth scenario (2400: 5.9M parameters)")
    p.add_argument("--bandwidth-intra-mbit", type=float, default=4000.0, help="host links, bandwidth scenario")
    p.add_argument("--bandwidth-inter-mbit", type=float, default=400.0, help="between racks, bandwidth scenario")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="every scenario: each training step also waits this many ms (an accelerator's compute)")
    p.add_argument("--accelerator-compute-ms", type=float, default=100.0,
                   help="accelerator scenario: the compute each step waits for, on the bandwidth scenario's model")
    p.add_argument("--straggler-period", type=float, default=6.0,
                   help="stragglers scenario: one host is slow once in each period of this many seconds")
    p.add_argument("--straggler-slow", type=float, default=3.0, help="seconds it stays slow")
    p.add_argument("--straggler-delay", type=float, default=0.25, help="seconds it adds to each of its steps")
    p.add_argument("--transient-from", type=float, default=2.0,
                   help="transient scenario: seconds into training when the last host becomes slow")
    p.add_argument("--transient-seconds", type=float, default=8.0, help="seconds it stays slow")
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--local-period", type=int, default=4,
                   help="averaging period of PostLocalSGD and of DS-Sync's local-step contenders")
    p.add_argument("--warmup-steps", type=int, default=0, help="bulk-synchronous warm-up (DS-Sync, PostLocalSGD)")
    p.add_argument("--task", choices=TASKS, default="synthetic",
                   help="synthetic: 5,000 test samples (0.02 pp each); digits: 360 (hvd_dssync.bench.metric)")
    p.add_argument("--eval-every", type=int, default=2,
                   help="steps between the model snapshots the accuracy curves are evaluated on, off the clock")
    p.add_argument("--snapshot-budget-mb", type=positive_float, default=SNAPSHOT_BUDGET_BYTES / 2 ** 20,
                   help="memory a rank may hold its model snapshots in; where --steps of them every --eval-every "
                        "steps do not fit, they are float16 and further apart, an odd number of steps (a large model's "
                        "curve is read on that coarser grid, at every place of an averaging period of a power of two "
                        "steps; each rank holds them until its job ends)")
    p.add_argument("--target", type=float, default=0.95, help="target test accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per contender and scenario, interleaved (each contender once, then again); the "
                        "table and the targets take the medians")
    p.add_argument("--vary-seed", action="store_true",
                   help="run k of --repeat uses seed + k (data order, initial model, batches; the same for "
                        "every contender in that run): the medians then cover the training's luck, not only "
                        "the timing's")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds before one contender's job is killed")
    p.add_argument("--out", default="bench-results", help="folder for results.json, results.md and the PNGs")
    p.add_argument("--loopback", action="store_true", help="run on loopback even where namespaces work")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild results.md from the results.json in --out")
    return p


def _write_markdown(payload, out):
    text = report.render_markdown(payload)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    return text


def report_only(out):
    """Rebuild ``out``/results.md from ``out``/results.json, running nothing (``make bench-report``)."""
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        print(f"bench: no {path}; run the bench first (make bench)", file=sys.stderr)
        return 2
    with open(path) as f:
        payload = json.load(f)
    print(_write_markdown(payload, out), end="")
    print(f"bench: wrote {out}/results.md from {path}")
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.report_only:
        return report_only(args.out)
    if args.ranks < 2 or args.racks < 1 or args.ranks % args.racks:
        print("bench: --ranks must be at least 2 and a multiple of --racks", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"bench: --repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    per_rack = args.ranks // args.racks
    if args.slots_per_host < 1 or per_rack % args.slots_per_host:
        print("bench: --slots-per-host must divide the ranks of each rack", file=sys.stderr)
        return 2
    if args.launcher == "bench" and args.slots_per_host > 1:
        print("bench: --slots-per-host > 1 needs --launcher horovodrun or mpirun", file=sys.stderr)
        return 2
    if args.launcher != "bench":
        other = [c for c in args.contenders if c not in HOROVOD_CONTENDERS]
        if other:
            print(f"bench: --launcher {args.launcher} launches Horovod jobs only; leave out {', '.join(other)} "
                  f"(--contenders from {', '.join(HOROVOD_CONTENDERS)})", file=sys.stderr)
            return 2
    racks = [list(range(k * per_rack, (k + 1) * per_rack)) for k in range(args.racks)]
    try:
        built = [scenario(s, args) for s in args.scenarios]
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    ok, why = (False, "--loopback given") if args.loopback else namespaces_available()
    if not ok and args.launcher != "bench":
        print(f"bench: --launcher {args.launcher} needs network namespaces ({why})", file=sys.stderr)
        return 2
    skipped = []
    if not ok:  # mpirun places ranks on the emulated hosts: none on loopback
        skipped = [{"contender": c, "why": f"needs mpirun across emulated hosts; network namespaces: {why}"}
                   for c in args.contenders if c in MPIRUN_ONLY]
        args.contenders = [c for c in args.contenders if c not in MPIRUN_ONLY]
        for item in skipped:
            print(f"bench: leaving out {item['contender']}: it {item['why']}")
        if not args.contenders:
            print("bench: no contender left to run", file=sys.stderr)
            return 2
    config = {"seed": args.seed, "task": args.task, "hidden": args.hidden, "batch": args.batch, "lr": args.lr, "momentum": args.momentum,
              "steps": args.steps, "eval_every": args.eval_every, "max_train_seconds": args.max_train_seconds,
              "snapshot_budget_bytes": int(args.snapshot_budget_mb * 2 ** 20),
              "calibration_steps": 10, "racks": racks, "local_period": args.local_period,
              "warmup_steps": args.warmup_steps, "target": args.target, "slots_per_host": args.slots_per_host}
    if ok:
        bed = Testbed([per_rack] * args.racks, intra_mbit=args.intra_mbit, inter_mbit=args.inter_mbit,
                      delay_ms=args.delay_ms, slots_per_host=args.slots_per_host)
        scenarios = built
    else:
        print(f"bench: network namespaces are not available ({why}); running on LOOPBACK: no racks, no "
              "shaping, no bottleneck to measure. These figures say nothing about a bottlenecked network.")
        bed = LoopbackBed([per_rack] * args.racks)
        scenarios = [{"name": "loopback", "intra_mbit": 0.0, "inter_mbit": 0.0, "rate_changes": [],
                      "hidden": args.hidden, "stragglers": None, "compute_ms": args.compute_ms}]
    os.makedirs(args.out, exist_ok=True)
    runs, run_rows, failures = [], [], []
    if args.launcher == "bench":
        launcher = ("Gloo controller; rendezvous server started by the bench inside rank 0's namespace; one "
                    "process per namespace; OMP_NUM_THREADS=1")
    else:
        launcher = (f"{args.launcher} from the first host's namespace, the other hosts reached through its "
                    f"remote-shell setting (hvd_dssync.bench.remote_shell); {args.slots_per_host} rank(s) per "
                    "host; " + ("Gloo controller, --network-interface eth0" if args.launcher == "horovodrun"
                                else "MPI controller and operations, btl tcp on eth0") + "; OMP_NUM_THREADS=1")
    launchers = {c: contender_launcher(c, args.launcher) for c in args.contenders}
    for c in (c for c in args.contenders if c in MPIRUN_ONLY):
        launcher += (f"; {c}: " + ("" if args.launcher == "mpirun" else
                                   f"mpirun from the first host's namespace, {args.slots_per_host} rank(s) per host, "
                                   "MPI controller and operations, ") +
                     "Open MPI's coll/han (--mca coll_han_priority 100 --mca coll_han_use_simple_allreduce 1), "
                     "HOROVOD_HIERARCHICAL_ALLREDUCE=1 (no effect on CPUs)")
    started = time.monotonic()
    with bed:
        testbed = bed.describe()
        print(f"bench: {testbed['mode']} testbed, racks {racks}, intra {args.intra_mbit} Mbit/s, inter "
              f"{args.inter_mbit} Mbit/s, delay {args.delay_ms} ms; launcher: {launcher}")
        for setting in scenarios:
            if testbed["mode"] == "namespaces":
                if setting["intra_mbit"] != bed.intra_mbit:
                    bed.set_host_rate(setting["intra_mbit"])
                bed.set_inter_rate(setting["inter_mbit"])
                print(f"  scenario {setting['name']}: hosts {setting['intra_mbit']:g} Mbit/s, between racks "
                      f"{setting['inter_mbit']:g} Mbit/s, MLP width {setting['hidden']}"
                      + (f", stragglers {setting['stragglers']}" if setting["stragglers"] else "")
                      + (f", {setting['compute_ms']:g} ms of emulated compute a step" if setting.get("compute_ms")
                         else ""), flush=True)
            contenders = args.contenders if setting["name"] in ("static", "loopback") else \
                [c for c in args.contenders if c in args.others_in]
            job_config = dict(config, hidden=setting["hidden"], stragglers=setting["stragglers"],
                              compute_ms=setting.get("compute_ms", 0.0))
            for run, contender in ((r, c) for r in range(args.repeat) for c in contenders):
                print(f"  [{setting['name']}] {contender}"
                      + (f" (run {run + 1} of {args.repeat})" if args.repeat > 1 else "") + " ...", flush=True)
                t0 = time.monotonic()
                run_config = dict(job_config, seed=config["seed"] + run) if args.vary_seed else job_config
                try:
                    if launchers[contender] == "bench":
                        record = run_contender(bed, contender, run_config, args.timeout,
                                               rate_changes=setting["rate_changes"])
                    else:
                        record = run_launched_contender(bed, launchers[contender], contender, run_config,
                                                        args.timeout, rate_changes=setting["rate_changes"])
                except JobFailed as e:
                    print(f"    FAILED: {e}", file=sys.stderr)
                    failures.append({"scenario": setting["name"], "contender": contender, "run": run,
                                     "error": str(e)[-4000:]})
                    continue
                row = report.summarize(record, setting, run_config)
                run_rows.append(row)
                runs.append({"scenario": setting["name"], "contender": contender, "run": run, "record": record})
                print(f"    {row['steps']} steps, median {row['median_step_s']:.3f} s, final accuracy "
                      f"{row['final_accuracy']:.1%}, time to target {row['time_to_target_s']}, "
                      f"bottleneck bytes {row['bottleneck_bytes']} (est. {row['bottleneck_bytes_estimate']:.0f}), "
                      f"sync/link-bound {row['sync_to_link_bound']} [{time.monotonic() - t0:.0f} s]", flush=True)
    rows = report.combine(run_rows)
    checks = report.targets(rows)
    payload = {"command": "python -m hvd_dssync bench " + " ".join(argv if argv is not None else sys.argv[1:]),
               "testbed": testbed, "launcher": launcher, "launchers": launchers, "skipped": skipped,
               "config": config, "repeat": args.repeat, "scenarios": scenarios, "rows": rows, "run_rows": run_rows,
               "runs": runs, "failures": failures,
               "targets": [{"target": t, "met": m, "figures": f} for t, m, f in checks],
               "wall_seconds": time.monotonic() - started, "cpu_count": os.cpu_count()}
    report.write_json(os.path.join(args.out, "results.json"), payload)
    text = _write_markdown(payload, args.out)
    print("\n" + text)
    if not args.no_plots and rows:
        from .plot import plot_results
        for path in plot_results(payload, args.out):
            print(path)
    print(f"bench: wrote {args.out}/results.json and results.md in {payload['wall_seconds']:.0f} s")
    return 1 if failures else 0
