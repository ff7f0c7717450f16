"""Command line: ``python -m hvd_dssync info | racks | simulate | bench | plot`` (also ``hvd-dssync``).

- ``info``: versions, what Horovod was built with, and the groups and process sets a job would use.
- ``racks``: the racks the default's rule finds in recorded figures (an optimizer's ``opt.sensed``), with
  its margin, or why it found one flat network.
- ``simulate``: consensus, spectral gap and slow-link cost of the schedules for 8 to 4096 workers.
- ``bench``, ``plot``: the emulated-cluster benchmark and its plots (:mod:`hvd_dssync.bench`).

Example::

    python -m hvd_dssync info -np 4 --num-groups 2
    python -m hvd_dssync racks sensed.json
    python -m hvd_dssync simulate --workers 8,64,512,4096 --json results/simulate.json
"""
import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys

import numpy as np

from . import __version__, build
from .schedules import SCHEDULE_NAMES, make_schedule
from .adaptive import AdaptivePolicy
from .bench.arguments import positive_float
from .simulate import (TABLE_SCHEDULES, format_table, parse_rate_changes, rack_topology, replay_adaptive,
                       simulate_table)

__all__ = ["main", "build_parser"]

PROG = "python -m hvd_dssync"
_PASSTHROUGH = {"bench": "hvd_dssync.bench.cli", "plot": "hvd_dssync.bench.plot"}
_SHOWN_GROUPS = 8
_SHOWN_WINDOWS = 2


def _int_list(text):
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected world sizes of at least 2, got {text!r}")
    return values


def _name_list(text):
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [n for n in names if n not in TABLE_SCHEDULES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected names among {','.join(TABLE_SCHEDULES)}, got {text!r}")
    return names


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser():
    """The argparse parser of all subcommands (``bench`` and ``plot`` take their own arguments).

    Example::

        >>> args = build_parser().parse_args(["info", "-np", "8", "--schedule", "butterfly"])
        >>> args.command, args.num_proc, args.schedule, args.seed
        ('info', 8, 'butterfly', 0)
    """
    parser = argparse.ArgumentParser(prog=PROG, description="DS-Sync for Horovod: inspect, simulate, benchmark.")
    parser.add_argument("--version", action="version", version=f"hvd_dssync {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    _add_info(commands)
    _add_racks(commands)
    _add_simulate(commands)
    for name, module in _PASSTHROUGH.items():
        commands.add_parser(name, add_help=False, help=f"run {module} (arguments go to it; try {name} --help)")
    return parser


def _add_info(commands):
    info = commands.add_parser("info", help="versions, Horovod's build, and the groups a job would use")
    info.add_argument("-np", "--num-proc", type=_positive_int, default=4, help="world size (default 4)")
    info.add_argument("--schedule", choices=SCHEDULE_NAMES, default="shuffle")
    info.add_argument("--num-groups", type=_positive_int, help="groups per step (shuffle; default 2 when "
                      "neither --num-groups nor --group-size is given)")
    info.add_argument("--group-size", type=_positive_int, help="largest group (shuffle) or butterfly group size")
    info.add_argument("--seed", type=int, default=0)
    info.add_argument("--rack-size", type=_positive_int,
                      help="ranks per rack for --schedule topology (default: half the ranks, two racks)")
    info.add_argument("--steps", type=_positive_int, default=4, help="steps whose groups to show (default 4)")
    info.add_argument("--no-build-check", action="store_true",
                      help="skip asking Horovod what it was built with (that loads each framework, seconds)")
    info.set_defaults(run=_run_info)


def _add_racks(commands):
    racks = commands.add_parser("racks", help="the racks the default's rule finds in recorded figures, its margin")
    racks.add_argument("figures", help="a JSON file: an optimizer's opt.sensed, or its seconds_by_pair alone")
    racks.add_argument("--min-margin", type=float, default=None,
                       help="the margin that counts as racks (default: hvd_dssync.sensing.MIN_MARGIN, 2)")
    racks.set_defaults(run=_run_racks)


def _run_racks(args, parser):
    """Print what the rack rule finds in a recorded ``opt.sensed`` (or its ``seconds_by_pair``)."""
    from .sensing import MIN_MARGIN, decide_racks, seconds_of_pairs

    try:
        with open(args.figures) as f:
            figures = json.load(f)
        by_pair = figures.get("seconds_by_pair", figures) if isinstance(figures, dict) else None
        leaders, seconds = seconds_of_pairs(by_pair)
    except (OSError, ValueError, AttributeError, TypeError) as e:
        parser.error(f"racks: cannot read pair figures from {args.figures}: {type(e).__name__}: {e}")
    if len(leaders) < 2:
        parser.error(f"racks: {args.figures} holds figures of fewer than two hosts")
    margin = MIN_MARGIN if args.min_margin is None else args.min_margin
    decision = decide_racks(seconds, margin)
    found = "one flat network" if decision.flat else \
        f"{len(decision.racks)} racks {[[leaders[h] for h in rack] for rack in decision.racks]}"
    print(f"{len(leaders)} hosts (first ranks {leaders}): {found}; {decision.describe(margin)}")
    if decision.ambiguous:
        print("pairs in doubt (timed again by the probe): "
              + ", ".join(f"{leaders[a]}-{leaders[b]}" for a, b in decision.ambiguous))
    return 0


def _add_simulate(commands):
    sim = commands.add_parser("simulate", help="consensus, spectral gap and slow-link cost, 8 to 4096 workers")
    sim.add_argument("--workers", type=_int_list, default=(8, 64, 512, 4096),
                     help="world sizes, comma separated (default 8,64,512,4096)")
    sim.add_argument("--schedule", type=_name_list, default=TABLE_SCHEDULES,
                     help=f"schedules, comma separated (default {','.join(TABLE_SCHEDULES)})")
    sim.add_argument("--num-groups", type=_positive_int, help="shuffle's groups per step (default: from --group-size)")
    sim.add_argument("--group-size", type=_positive_int, default=4, help="shuffle's and butterfly's group size (default 4)")
    sim.add_argument("--steps", type=_positive_int, default=1000,
                     help="steps simulated: the horizon for reaching --target and for the link means (default 1000)")
    sim.add_argument("--error-steps", type=_positive_int, default=10, help="report the error after this many steps")
    sim.add_argument("--target", type=positive_float, default=1e-3, help="consensus error to reach (default 1e-3)")
    sim.add_argument("--rack-size", type=_positive_int, default=8, help="consecutive ranks per rack (default 8)")
    sim.add_argument("--cross-rack-gbps", type=positive_float, default=1.0, help="rack uplink rate (default 1)")
    sim.add_argument("--intra-rack-gbps", type=positive_float, default=10.0, help="host NIC rate (default 10)")
    sim.add_argument("--model-mb", type=positive_float, default=100.0, help="model size in MB of 1e6 bytes (default 100)")
    sim.add_argument("--average-every", type=_positive_int, default=1,
                     help="DS-Sync schedules average on one step in this many, local steps between (default 1)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--adaptive", action="store_true",
                     help="replay the adaptive policy on the first --workers size, racks of --rack-size, under "
                          "--rate-change; prints its decisions and the time of --steps steps against each fixed mode")
    sim.add_argument("--rate-change", default="", metavar="CHANGES",
                     help='with --adaptive: link rates over simulated time, "t=30:inter=4,t=60:inter=40" '
                          "(seconds, Gb/s; inter: rack uplinks, intra: NICs) or a JSON timetable file")
    sim.add_argument("--decide-every", type=_positive_int, default=64,
                     help="with --adaptive: steps between decisions (default 64)")
    sim.add_argument("--compute-ms", type=positive_float, default=200.0,
                     help="with --adaptive: compute time of a step, in ms (default 200)")
    sim.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    sim.set_defaults(run=_run_simulate)


def _run_adaptive(args, parser):
    try:
        policy = AdaptivePolicy(decide_every=args.decide_every, min_period=args.average_every,
                                max_period=8 * args.average_every)
        out = replay_adaptive(world_size=args.workers[0], rack_size=args.rack_size, steps=args.steps,
                              rate_changes=parse_rate_changes(args.rate_change),
                              intra_rack_gbps=args.intra_rack_gbps, cross_rack_gbps=args.cross_rack_gbps,
                              model_bytes=args.model_mb * 1e6, compute_seconds=args.compute_ms / 1e3, policy=policy)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    print(f"{args.workers[0]} ranks, racks of {args.rack_size}, model of {args.model_mb:g} MB, "
          f"{args.compute_ms:g} ms of compute per step; rates: uplinks {args.cross_rack_gbps:g} Gb/s, "
          f"NICs {args.intra_rack_gbps:g} Gb/s, then {args.rate_change or 'unchanged'}.\n")
    print("| step | t (s) | mode | average every | global ms | group ms | why |")
    print("|--:|--:|:--|--:|--:|--:|:--|")
    def ms(seconds):  # not measured yet: -
        return "-" if math.isnan(seconds) else f"{seconds * 1e3:.4g}"

    for d in out["decisions"]:
        if d["reason"] != "unchanged" or d is out["decisions"][0]:
            print(f"| {d['step']} | {d['t']:.1f} | {d['mode']} | {d['period']} | {ms(d['global_seconds'])} | "
                  f"{ms(d['group_seconds'])} | {d['reason']} |")
    print("\n" + ", ".join(f"{k}: {v:.1f} s" for k, v in out["seconds"].items()) + f" for {args.steps} steps")
    if args.json:
        _write_json(args.json, out)
    return 0


def _run_simulate(args, parser):
    if args.adaptive:
        return _run_adaptive(args, parser)
    try:
        rows = simulate_table(workers=args.workers, schedules=args.schedule, num_groups=args.num_groups,
                              group_size=args.group_size, rack_size=args.rack_size,
                              intra_rack_gbps=args.intra_rack_gbps, cross_rack_gbps=args.cross_rack_gbps,
                              model_bytes=args.model_mb * 1e6, error_steps=args.error_steps, max_steps=args.steps,
                              target=args.target, seed=args.seed, average_every=args.average_every)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    print(f"Racks of {args.rack_size} consecutive ranks (half the ranks when N <= {args.rack_size}), uplinks at "
          f"{args.cross_rack_gbps:g} Gb/s, NICs at {args.intra_rack_gbps:g} Gb/s, model of {args.model_mb:g} MB; "
          f"link figures are means over {args.steps} steps.\n")
    print(format_table(rows))
    if args.json:
        _write_json(args.json, rows)
    return 0


def _write_json(path, payload):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"\nwrote {path}")


# Distributions that install each module: TensorFlow ships under several names (the venv has tensorflow-cpu).
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos", "intel-tensorflow"),
    "horovod": ("horovod",),
}


def _installed_version(module):
    """The installed version of ``module`` without importing it (TensorFlow takes seconds), or None."""
    if importlib.util.find_spec(module) is None:
        return None
    for distribution in _DISTRIBUTIONS[module]:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed, version unknown"


def _versions():
    versions = {"hvd_dssync": __version__, "python": f"{platform.python_version()} ({sys.executable})",
                "numpy": np.__version__}
    for module in _DISTRIBUTIONS:
        versions[module] = _installed_version(module) or "not installed"
    return versions


def _horovod_build():
    """What ``horovodrun -cb`` reports, from the same functions: each loads a framework in a subprocess."""
    try:
        from horovod.common import util
    except ImportError as e:
        return f"not available ({e})"
    # The checks run in child processes that import TensorFlow; keep its start-up banner out of the report.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    checks = {"PyTorch": lambda: util.extension_available("torch"),
              "TensorFlow": lambda: util.extension_available("tensorflow"),
              "Gloo": util.gloo_built, "MPI": util.mpi_built}
    parts = []
    for name, check in checks.items():
        try:
            parts.append(f"{name} {'yes' if check() else 'no'}")
        except Exception as e:  # a broken build must not hide the rest of the report
            parts.append(f"{name} unknown ({type(e).__name__}: {e})")
    return ", ".join(parts)


def _format_groups(groups):
    shown = " ".join("[" + " ".join(str(r) for r in g) + "]" for g in groups[:_SHOWN_GROUPS])
    more = len(groups) - _SHOWN_GROUPS
    return shown + (f" ... (+{more} more)" if more > 0 else "")


def _info_schedule(args):
    n = args.num_proc
    num_groups, group_size = args.num_groups, args.group_size
    if args.schedule == "shuffle" and num_groups is None and group_size is None:
        num_groups = min(2, n)
    topology = None
    if args.schedule == "topology":
        topology = rack_topology(n, args.rack_size or max(1, n // 2))
    return make_schedule(args.schedule, n, num_groups=num_groups, group_size=group_size, seed=args.seed,
                         topology=topology)


def _run_info(args, parser):
    try:
        schedule = _info_schedule(args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    for name, version in _versions().items():
        print(f"{name:<11} {version}")
    if not args.no_build_check:
        print(f"{'built with':<11} {_horovod_build()}")
        level = build.patch_level()
        print(f"{'patch level':<11} {level} " + ("(Horovod as released)" if level == 0 else
                                                 f"(the project's build; current {build.PATCH_LEVEL})"))
        if build.supported(level):
            print(f"{'supports':<11} {', '.join(build.supported(level))}")
        for missing in build.missing_patches(level):
            print(f"{'':<11} lacks {missing}")
    print(f"\nschedule    {schedule!r}")
    if getattr(schedule, "topology", None) is not None:
        print(f"racks       {_format_groups(schedule.topology.rack_ranks())}")
    print(f"\ngroups of the first {args.steps} steps (-np {args.num_proc}):")
    for step in range(args.steps):
        print(f"  step {step:<4} {_format_groups(schedule.groups(step))}")
    print("\nprocess sets per window (the distinct groups registered while the window runs):")
    for window in range(_SHOWN_WINDOWS):
        groups = schedule.window_groups(window)
        first = schedule.window_start(window)
        span = "all steps" if schedule.window_steps is None else f"steps {first}-{first + schedule.window_steps - 1}"
        print(f"  window {window} ({span}): {len(groups)} sets: {_format_groups(groups)}")
        if schedule.window_steps is None:
            break
    return 0


def _run_passthrough(command, argv):
    module_name = _PASSTHROUGH[command]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        print(f"{PROG} {command}: cannot import {module_name} ({type(e).__name__}: {e}); the benchmark "
              "is missing from this installation or lacks one of its requirements.", file=sys.stderr)
        return 2
    status = module.main(argv)
    return 0 if status is None else status


def main(argv=None):
    """Run one subcommand and return its exit status.

    Example::

        >>> main(["simulate", "--workers", "8", "--schedule", "butterfly", "--steps", "20"])  # doctest: +ELLIPSIS
        Racks of 8 ...
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        # bench and plot parse their own arguments, "--help" included.
        return _run_passthrough(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, parser)


if __name__ == "__main__":
    sys.exit(main())
