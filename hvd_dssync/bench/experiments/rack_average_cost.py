"""What one average inside a rack costs through Horovod process sets and through ``torch.distributed``
subgroups, side by side on the bench's emulated cluster.

Every rank takes ``--local`` steps of the bench's MLP, then averages its model (1.2 MB; ``--hidden 4``:
1.3 kB, what an op costs whatever its size) with its rack,
``--iterations`` times (40) after 5 untimed ones; the figure is the time of one iteration, the median
over the ranks. Four rows, each a Horovod job and a PyTorch job: the local steps alone (the compute's
share, no average); the local steps, then the average; each local step replaced by a sleep of
``--step-seconds`` (the averages without the cores shared by computing ranks); the averages alone. A
fifth row times the last rack's averages alone while ranks 0 and 1 (of the first rack) average 5 MB between
themselves, in a process set (a subgroup) of their own: what an op of other ranks costs a rack's average.
Horovod runs three times: with the sets marked ordered as DS-Sync marks its groups (patch level 9: the
averages skip the negotiation), with the build's concurrent process sets negotiated
(``HOROVOD_ORDERED_PROCESS_SETS=0``), and with every op in its background loop
(``HOROVOD_PROCESS_SETS_ASYNC=0``, as released).
Run as root from the repository root::

    .venv/bin/python hvd_dssync/bench/experiments/rack_average_cost.py --ranks 8 --racks 2

Each job is launched once, Horovod's with ``horovodrun --gloo`` from the first host and PyTorch's one
process per namespace, each under a timeout; a job that fails or times out is reported as such.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BESIDE_BYTES = 5_000_000
# Horovod's ways of running a set's average, each a column: the sets ordered (as DS-Sync marks its groups),
# negotiated, every op in Horovod's loop (as released); their --worker library names and column heads.
HOROVOD_WAYS = {"ordered": ("horovod", "Horovod, ordered sets"),
                "negotiated": ("horovod-negotiated", "negotiated"),
                "loop": ("horovod-loop", "every op in Horovod's loop")}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
from hvd_dssync.bench.arguments import integers, names, positive_float  # noqa: E402


def _train_steps(model, optimizer, x, y, iteration, local, sleep):
    import torch

    loss_fn = torch.nn.CrossEntropyLoss()
    for k in range(local):
        if sleep:
            time.sleep(sleep)
            continue
        start = ((iteration * local + k) * 16) % (len(y) - 16)
        optimizer.zero_grad()
        loss_fn(model(x[start:start + 16]), y[start:start + 16]).backward()
        optimizer.step()


def worker(library, racks, local, sleep, averages=True, iterations=40, warmup=5, beside=False, hidden=512):
    """One rank: ``local`` steps then the rack's average (none without ``averages``), timed; prints the
    ranks' figures on rank 0. ``beside``: ranks 0 and 1 average :data:`BESIDE_BYTES` between themselves
    instead, the first rack's other ranks do nothing, the other racks average as before."""
    import torch

    from hvd_dssync.bench.catalog import build_model
    from hvd_dssync.bench.metric import load_data

    torch.set_num_threads(1)
    bounds = [sum(racks[:k]) for k in range(len(racks) + 1)]
    if library == "horovod":
        import horovod.torch as hvd

        from hvd_dssync.torch import collectives

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        from hvd_dssync.process_sets import mark_ordered

        sets = [hvd.add_process_set(list(range(bounds[k], bounds[k + 1]))) for k in range(len(racks))]
        # Horovod refuses a second set of the same ranks: racks of 2 have the pair's set already.
        pair = (sets[0] if racks[0] == 2 else hvd.add_process_set([0, 1])) if beside else None
        for ps in sets + ([pair] if pair is not None else []):
            mark_ordered(ps)  # as DS-Sync's registry does (nothing where HOROVOD_ORDERED_PROCESS_SETS=0)
    else:
        import torch.distributed as dist
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        sets = [dist.new_group(list(range(bounds[k], bounds[k + 1]))) for k in range(len(racks))]
        pair = dist.new_group([0, 1]) if beside else None
    mine = next(k for k in range(len(racks)) if bounds[k] <= rank < bounds[k + 1])
    model = build_model(hidden, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y, _, _ = load_data(0)
    x, y = torch.from_numpy(x[rank::size]), torch.from_numpy(y[rank::size])
    tensors = [p.data for p in model.parameters()]
    big = torch.ones(BESIDE_BYTES // 4)

    def average():
        if not averages or (beside and mine == 0 and rank > 1):
            return
        if beside and rank <= 1:
            if library == "horovod":
                collectives.allreduce_(big, name="pair", op=hvd.Average, process_set=pair)
            else:
                dist.all_reduce(big, group=pair)
            return
        if library == "horovod":
            collectives.grouped_allreduce_(tensors, name="rack", op=hvd.Average, process_set=sets[mine])
        else:
            average_parameters(model.parameters(), sets[mine])  # PyTorch's averagers' own average

    for k in range(warmup):
        _train_steps(model, optimizer, x, y, k, local, sleep)
        average()
    started = time.perf_counter()
    for k in range(iterations):
        _train_steps(model, optimizer, x, y, k, local, sleep)
        average()
    mine_ms = torch.tensor([(time.perf_counter() - started) / iterations * 1e3])
    if library == "horovod":
        figures = hvd.allgather(mine_ms, name="figures").tolist()
    else:
        gathered = [torch.zeros(1) for _ in range(size)]
        dist.all_gather(gathered, mine_ms)
        figures = [float(t[0]) for t in gathered]
    if rank == 0:
        print("FIGURES " + json.dumps(figures), flush=True)


def _figures(output):
    for line in output.splitlines():
        if "FIGURES " in line:
            return json.loads(line.split("FIGURES ", 1)[1])
    return None


def run_job(bed, library, racks, local, sleep, averages, iterations, timeout, beside=False, cycle_time_ms=None,
            hidden=512):
    """One job on ``bed``; the ranks' milliseconds per iteration, or the reason there are none.
    ``library`` "horovod": the sets ordered; "horovod-negotiated": concurrent process sets, each op negotiated
    (``HOROVOD_ORDERED_PROCESS_SETS=0``); "horovod-loop": every op in Horovod's background loop, as released
    (``HOROVOD_PROCESS_SETS_ASYNC=0`` on the project's build). ``cycle_time_ms``: Horovod's
    ``HOROVOD_CYCLE_TIME`` (its own default, 1 ms, when None). ``hidden``: the MLP's width."""
    loop_bound = library == "horovod-loop"
    negotiated = library in ("horovod-loop", "horovod-negotiated")
    library = "horovod" if library.startswith("horovod") else library
    from hvd_dssync.bench.launchers import head_command, launch_command, launch_env

    argv = [sys.executable, os.path.abspath(__file__), "--worker", library, "--racks-list", json.dumps(racks),
            "--local", str(local), "--sleep", str(sleep), "--iterations", str(iterations), "--hidden", str(hidden),
            *(() if averages else ("--no-averages",)), *(("--beside",) if beside else ())]
    with tempfile.TemporaryDirectory() as agent_dir:
        if library == "horovod":
            env = launch_env(bed, "horovodrun", agent_dir)
            env["PYTHONPATH"] = ROOT
            env["HOROVOD_PROCESS_SETS_ASYNC"] = "0" if loop_bound else "1"
            env["HOROVOD_ORDERED_PROCESS_SETS"] = "0" if negotiated else "1"
            if cycle_time_ms is not None:
                env["HOROVOD_CYCLE_TIME"] = f"{cycle_time_ms:g}"
            command = head_command(bed, launch_command(bed, "horovodrun", argv, agent_dir))
            procs = [subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)]
        else:
            procs = []
            for rank in range(bed.size):
                env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
                           MASTER_ADDR=bed.address(0), MASTER_PORT="29511", RANK=str(rank),
                           WORLD_SIZE=str(bed.size))
                procs.append(bed.popen(rank, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
        deadline = time.monotonic() + timeout
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:.0f} s"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    figures = _figures(outputs[0])
    if figures is None:
        return None, f"exit {procs[0].returncode}: {outputs[0][-500:]}"
    return figures, None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hvd_dssync/bench/experiments/rack_average_cost.py")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--racks", type=int, default=2)
    parser.add_argument("--intra-mbit", type=float, default=400.0)
    parser.add_argument("--inter-mbit", type=float, default=40.0)
    parser.add_argument("--local", type=int, default=4, help="local steps before each average")
    parser.add_argument("--step-seconds", type=float, default=0.004,
                        help="what a local step sleeps in the sleeping row (about a step's wall time here)")
    parser.add_argument("--iterations", type=int, default=40, help="timed iterations (after 5 untimed)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before a job is killed")
    parser.add_argument("--rows", type=integers("row", 1, 5), default=[1, 2, 3, 4, 5],
                        help="which of the five rows to run, comma-separated (default: all)")
    parser.add_argument("--horovod", type=names("way", HOROVOD_WAYS), default=list(HOROVOD_WAYS),
                        help="which of Horovod's ways to time, comma-separated (default: all)")
    parser.add_argument("--cycle-time-ms", type=positive_float, default=None,
                        help="HOROVOD_CYCLE_TIME for the Horovod jobs (default: Horovod's, 1 ms)")
    parser.add_argument("--hidden", type=int, default=512,
                        help="the MLP's width (512: 1.2 MB averaged; 4: 1.3 kB, what an op costs whatever its size)")
    parser.add_argument("--worker", choices=("horovod", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--racks-list", help=argparse.SUPPRESS)
    parser.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--no-averages", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--beside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.racks_list), args.local, args.sleep, not args.no_averages,
               args.iterations, beside=args.beside, hidden=args.hidden)
        return 0
    if args.racks < 1 or args.ranks < 2 * args.racks or args.ranks % args.racks:
        parser.error(f"--ranks {args.ranks} does not split into {args.racks} racks of at least 2 ranks each")
    from hvd_dssync.bench.testbed import Testbed

    racks = [args.ranks // args.racks] * args.racks
    local, sleep = args.local, args.step_seconds
    # (label, local steps, seconds each sleeps instead of training, averages, beside a long average of 0 and 1)
    rows = [(f"{local}, training, no average", local, 0.0, False, False),
            (f"{local}, training", local, 0.0, True, False),
            (f"{local}, sleeping {sleep * 1e3:g} ms each", local, sleep, True, False),
            ("none", 0, 0.0, True, False),
            (f"none; the last rack's, while ranks 0 and 1 average {BESIDE_BYTES / 1e6:g} MB", 0, 0.0, True, True)]
    rows = [rows[k - 1] for k in args.rows]
    cycle = "unset (1 ms)" if args.cycle_time_ms is None else f"{args.cycle_time_ms:g} ms"
    from hvd_dssync.bench.catalog import build_model

    model_bytes = 4 * sum(p.numel() for p in build_model(args.hidden, 0).parameters())
    print(f"{args.ranks} ranks in racks {racks}, a model of {model_bytes:,} bytes; hosts {args.intra_mbit:g} "
          f"Mbit/s, between racks {args.inter_mbit:g} Mbit/s; HOROVOD_CYCLE_TIME {cycle}; ms per iteration, "
          "median over the ranks", flush=True)
    ways = args.horovod
    print(f"| local steps before each average | {' | '.join(HOROVOD_WAYS[w][1] for w in ways)} | "
          f"torch.distributed subgroups | "
          f"{' | '.join(f'ratio, {w}' for w in ways)} |\n|---|{'---:|' * (2 * len(ways) + 1)}")
    with Testbed(racks=racks, intra_mbit=args.intra_mbit, inter_mbit=args.inter_mbit) as bed:
        for label, steps, pause, averages, beside in rows:
            cells = []
            for library in [HOROVOD_WAYS[w][0] for w in ways] + ["torch"]:
                figures, failed = run_job(bed, library, racks, steps, pause, averages, args.iterations,
                                          args.timeout, beside=beside, cycle_time_ms=args.cycle_time_ms,
                                          hidden=args.hidden)
                if figures and beside:
                    figures = figures[sum(racks[:-1]):]  # the last rack's, beside the long average
                cells.append(statistics.median(figures) if figures else None)
                if failed:
                    print(f"  {library} ({label}): {failed}", file=sys.stderr, flush=True)
            text = [("failed" if c is None else f"{c:.0f}" if c >= 10 else f"{c:.2f}") for c in cells]
            ratios = [f"{c / cells[-1]:.2f}x" if None not in (c, cells[-1]) else "-" for c in cells[:-1]]
            print(f"| {label} | {' | '.join(text)} | {' | '.join(ratios)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
