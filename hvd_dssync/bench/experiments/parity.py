"""Accuracy parity of DS-Sync's local-step settings, and of PyTorch's model averagers, against Horovod's
bulk-synchronous optimizer.

Run from the repository root with 4 ranks (the DS-Sync configurations use the topology-aware schedule on
2 racks of 2 unless they name a schedule; the hierarchical averagers average those racks);
``PYTHONPATH=.`` makes the ranks import this checkout's ``hvd_dssync``::

    PYTHONPATH=. OMP_NUM_THREADS=1 HOROVOD_GLOO_IFACE=lo timeout -k 10 2400 \\
        horovodrun -np 4 -H localhost:4 --gloo python hvd_dssync/bench/experiments/parity.py --seeds 0,1,2 --json parity.json

On 2 CPU cores, Horovod and three DS-Sync configurations over 10 seeds took 412 s (2026-12-05), most of it
Horovod's own runs; the whole default run (4 tasks x 3 seeds x every configuration) was not timed since the list
grew past 21 configurations (about 20 minutes then).

One job loops over tasks x seeds x configurations, in the same order on every rank. Each configuration
builds a fresh MLP from the seed, broadcasts it from rank 0, trains it for the task's fixed epoch budget
(per-rank batch 32, disjoint shards of the training split, SGD with momentum 0.9 and lr = base_lr x ranks,
Horovod's recipe, the same for every configuration), then evaluates on the task's 25% stratified test split.
A DS-Sync or averager configuration is evaluated twice: rank 0's own model, then the consensus model after
``hvd_dssync.torch.synchronize_models``. Horovod's model is the same on every rank, so both are its accuracy.

Rank 0 prints one table per task: the median test accuracy over seeds (each seed in brackets) and its
difference in percentage points from ``horovod``, for the rank-0 model and for the consensus model.
"""
import argparse
import json
import os
import statistics
import time

import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(): enables the dynamic process sets DS-Sync adds
from hvd_dssync.bench.arguments import integers
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer, load_digits, load_wine, make_classification
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from hvd_dssync.bench.report import bootstrap_interval
from hvd_dssync.bench.catalog import AVERAGER_PERIODS
from hvd_dssync.bench.worker import postlocal_optimizer
from hvd_dssync.fragments import FRAGMENTS_ENV

RACKS = [[0, 1], [2, 3]]


def synthetic(seed):
    return make_classification(n_samples=6000, n_features=40, n_informative=20, n_classes=10,
                               n_clusters_per_class=2, class_sep=1.0, random_state=seed)


# name -> (loader(seed) -> (X, y), default epochs). Epochs: Horovod on a plateau, the whole job short.
TASKS = {
    "digits": (lambda seed: load_digits(return_X_y=True), 20),
    "breast_cancer": (lambda seed: load_breast_cancer(return_X_y=True), 24),
    "wine": (lambda seed: load_wine(return_X_y=True), 40),
    "synthetic": (synthetic, 30),
}

# name -> DS-Sync's keyword arguments (None: Horovod's own optimizer). "warmup_steps": "epoch" is one
# epoch's steps, filled in per task.
# The topology-aware configurations with bridge steps name ``global_every`` (0 or a period) and the bridges'
# rhythm: the default's racks meet only in global averages (hvd_dssync.config.default_rack_rhythm).
BRIDGES = {"global_every": 0}
CONFIGS = {
    "horovod": None,
    # The default on racks: a rack's average every 8 steps, every rank every 32, no bridge step.
    "dssync-default": {},
    "dssync-every-1": {"average_every": 1, **BRIDGES},
    "dssync-every-2": {"average_every": 2, **BRIDGES},
    "dssync-every-4": {"average_every": 4, **BRIDGES},
    "dssync-every-6": {"average_every": 6, **BRIDGES},
    "dssync-every-8": {"average_every": 8, **BRIDGES},
    # The racks every 4 steps, the slow link every 32 (7 steps inside the racks between bridges).
    "dssync-every-4-cross-32": {"average_every": 4, **BRIDGES, "schedule_options": {"intra_steps": 7}},
    # The racks every 8 steps, the slow link every 16 (one average inside the racks between bridges).
    "dssync-every-8-cross-16": {"average_every": 8, **BRIDGES, "schedule_options": {"intra_steps": 1}},
    "dssync-every-8-plain-bridges": {"average_every": 8, **BRIDGES, "schedule_options": {"exact_bridges": False}},
    "dssync-every-8-global-32": {"average_every": 8, "global_every": 32, "schedule_options": {"intra_steps": 3}},
    # The default's rhythm with its global averages through the racks (one bridge rank of each rack).
    "dssync-racks-8-global-32": {"average_every": 8, "global_every": 32,
                                 "schedule_options": {"intra_steps": None, "global_via_bridges": True}},
    "dssync-every-4-outer": {"average_every": 4, **BRIDGES, "outer_momentum": 0.5},
    # Averages behind the local steps, folded in once done (the default's choice where its trial keeps it).
    "dssync-every-4-overlap": {"average_every": 4, **BRIDGES, "overlap": True},
    "dssync-default-overlap": {"overlap": True},
    # The same with each global average in 8 fragments, one a step through the period (the default's trial
    # chooses fragments where one ring of the model cannot hide behind a step: hvd_dssync.overlap).
    "dssync-default-overlap-f8": {"overlap": True, "environ": {FRAGMENTS_ENV: "8"}},
    # The rhythm the default's trial takes where the racks' averages hide (hvd_dssync.rhythm), here from the start:
    # the racks every 4 steps, the period built (8) after each global average, every rank every 32, every average in
    # flight, each global one in 8 fragments, one a step. No argument asks for it: the plan takes the period as the
    # adapter takes the trial's (SyncPlan.change_period, "racks_every").
    "dssync-default-quickened": {"overlap": True, "environ": {FRAGMENTS_ENV: "8"}, "racks_every": 4},
    # The way the default's trial takes where only the global averages hide: each in 8 fragments, one a step, in
    # flight; the racks' averages waited for, as the adapter waits for them where the trial turns overlap off. No
    # argument asks for it.
    "dssync-default-fragments": {"overlap": True, "environ": {FRAGMENTS_ENV: "8"}, "racks_waited": True},
    # The same as the default's trial runs it where it keeps overlap: the global averages through the racks,
    # waited for.
    "dssync-default-overlap-route": {"overlap": True, "schedule_options": {"global_via_bridges": True}},
    "dssync-every-4-warmup": {"average_every": 4, **BRIDGES, "warmup_steps": "epoch"},
    # Post-local SGD in DS-Sync (one group of every rank, every 4 steps): PyTorch's periodic averager's rule.
    "dssync-one-group-every-4": {"schedule": "shuffle", "num_groups": 1, "average_every": 4},
    "dssync-one-group-every-8": {"schedule": "shuffle", "num_groups": 1, "average_every": 8},
    "dssync-one-group-every-16": {"schedule": "shuffle", "num_groups": 1, "average_every": 16},
    # The racks every 4 steps and every rank every 16 (global_every), bridges between.
    "dssync-every-4-global-16": {"average_every": 4, "global_every": 16, "schedule_options": {"intra_steps": 3}},
}
# PyTorch's post-local SGD averagers at the bench's periods, built as the bench builds them
# (hvd_dssync.bench.worker.postlocal_optimizer: periodic every p; hierarchical, the rack every p/2 and all
# every 2p), on torch.distributed's Gloo beside Horovod: the price in accuracy of the bench's fastest contender.
AVERAGERS = {f"postlocal-{kind}-p{p}": p for kind in ("periodic", "hierarchical") for p in AVERAGER_PERIODS}
CONFIGS.update(dict.fromkeys(AVERAGERS, "pytorch"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, from: " + ", ".join(TASKS))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS))
    parser.add_argument("--seeds", type=integers("seed", 0), default=[0, 1, 2], help="comma-separated integers")
    parser.add_argument("--epochs", type=int, help="override every task's epoch budget")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--base-lr", type=float, default=0.02, help="per rank; scaled by the world size")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--json", help="write all results here (rank 0)")
    args = parser.parse_args()
    args.tasks = args.tasks.split(",")
    args.configs = args.configs.split(",")
    unknown = [t for t in args.tasks if t not in TASKS] + [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown task or configuration: {', '.join(unknown)}")
    if "horovod" not in args.configs:
        args.configs.insert(0, "horovod")  # the reference of every difference
    return args


def load_task(task, seed):
    """Standardized float32 tensors of a fixed 25% stratified test split (by seed)."""
    x, y = TASKS[task][0](seed)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.from_numpy(scaler.transform(a).astype(np.float32))  # noqa: E731
    as_y = lambda a: torch.from_numpy(np.asarray(a)).long()  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train_one(config, data, seed, epochs, args):
    """Train one configuration from the seed's initial model; return its accuracies (every rank)."""
    x_train, y_train, x_test, y_test = data
    size, rank = hvd.size(), hvd.rank()
    shard = torch.arange(rank, len(x_train), size)  # disjoint shards
    x_local, y_local = x_train[shard], y_train[shard]
    steps_per_epoch = max(1, (len(x_train) // size) // args.batch_size)  # the smallest shard's, on every rank

    torch.manual_seed(seed)
    classes = int(y_train.max()) + 1
    model = torch.nn.Sequential(torch.nn.Linear(x_train.shape[1], args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, classes))
    opt = torch.optim.SGD(model.parameters(), lr=args.base_lr * size, momentum=0.9)
    options, net = CONFIGS[config], model
    if options is None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    elif options == "pytorch":
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model)
        opt = postlocal_optimizer(config, net, opt, AVERAGERS[config], RACKS, size)
    else:
        options = dict(options)
        if options.get("warmup_steps") == "epoch":
            options["warmup_steps"] = steps_per_epoch
        if "schedule" not in options:
            options["topology"] = RACKS  # the topology-aware schedule on the racks
        environ = options.pop("environ", {})  # read as the optimizer is built
        racks_every = options.pop("racks_every", None)
        racks_waited = options.pop("racks_waited", False)
        os.environ.update(environ)
        try:
            opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model, **options)
        finally:
            for name in environ:
                del os.environ[name]
        if racks_every is not None:
            opt._plan.change_period(0, racks_every)  # as DSSyncOptimizer._follow_trial does
        if racks_waited:
            opt._averaging.overlap = False  # as the trial's choice sets it at each step
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if options != "pytorch":
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    generator = torch.Generator().manual_seed(1000 * seed + rank)  # the same batches for every configuration
    started = time.perf_counter()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x_local), generator=generator)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            F.cross_entropy(net(x_local[batch]), y_local[batch]).backward()
            opt.step()
    seconds = time.perf_counter() - started

    own = accuracy(model, x_test, y_test)
    if options is None:
        return {"rank0": own, "consensus": own, "distance": 0.0, "seconds": seconds, "steps": steps_per_epoch * epochs}
    distance = dss.consensus_distance(model)
    dss.synchronize_models(model)
    return {"rank0": own, "consensus": accuracy(model, x_test, y_test), "distance": distance,
            "seconds": seconds, "steps": steps_per_epoch * epochs}


def summarize(results, seeds):
    """Add medians over seeds and their differences from horovod (percentage points), per task."""
    for task, by_config in results.items():
        reference = {k: statistics.median(by_config["horovod"]["seeds"][s][k] for s in seeds)
                     for k in ("rank0", "consensus")}
        for entry in by_config.values():
            for k in ("rank0", "consensus"):
                entry[f"{k}_median"] = statistics.median(entry["seeds"][s][k] for s in seeds)
                entry[f"{k}_diff_pp"] = 100 * (entry[f"{k}_median"] - reference[k])
                paired = [100 * (entry["seeds"][s][k] - by_config["horovod"]["seeds"][s][k]) for s in seeds]
                entry[f"{k}_worst_paired_pp"] = min(paired)
                # The decision's figure: the paired difference from Horovod, seed by seed, its median and
                # bootstrap 95% interval (hvd_dssync.bench.report.bootstrap_interval).
                entry[f"{k}_paired_pp"] = statistics.median(paired)
                entry[f"{k}_paired_interval"] = bootstrap_interval(paired)
            entry["distance_median"] = statistics.median(entry["seeds"][s]["distance"] for s in seeds)


def print_tables(results, seeds, meta):
    for task, by_config in results.items():
        m = meta[task]
        print(f"\n== {task}: {m['epochs']} epochs x {m['steps_per_epoch']} steps, test set {m['test']} samples "
              f"(1 sample = {100 / m['test']:.2f} pp); accuracy %, median [seeds {','.join(map(str, seeds))}]")
        print(f"{'configuration':<24}{'rank-0 model':>28}{'Δ pp, paired [95%]':>26}{'consensus model':>28}"
              f"{'Δ pp, paired [95%]':>26}{'distance':>10}")
        for config, e in by_config.items():
            cells = []
            for k in ("rank0", "consensus"):
                each = " ".join(f"{100 * e['seeds'][s][k]:.1f}" for s in seeds)
                interval = e[k + "_paired_interval"]
                paired = f"{e[k + '_paired_pp']:+.2f}" + (f" [{interval[0]:+.2f}, {interval[1]:+.2f}]" if interval else "")
                cells.append(f"{100 * e[k + '_median']:>7.2f} [{each}]".rjust(28) + paired.rjust(26))
            print(f"{config:<24}{cells[0]}{cells[1]}{e['distance_median']:>10.1e}")


def init_torch_distributed():
    """torch.distributed's Gloo group for PyTorch's averagers, on a port rank 0 found free (every rank runs
    on this host: the script is a single-host job)."""
    import socket

    import torch.distributed as dist
    port = 0
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if hvd.size() != 4:
        raise SystemExit(f"run with 4 ranks (2 racks of 2), not {hvd.size()}")
    if any(c in AVERAGERS for c in args.configs):
        init_torch_distributed()
    results, meta = {}, {}
    started = time.perf_counter()
    for task in args.tasks:
        epochs = args.epochs or TASKS[task][1]
        results[task] = {c: {"seeds": {}} for c in args.configs}
        for seed in args.seeds:
            data = load_task(task, seed)
            meta[task] = {"epochs": epochs, "test": len(data[3]), "train": len(data[0]),
                          "steps_per_epoch": max(1, (len(data[0]) // hvd.size()) // args.batch_size)}
            for config in args.configs:
                r = train_one(config, data, seed, epochs, args)
                results[task][config]["seeds"][seed] = r
                if hvd.rank() == 0:
                    print(f"[{time.perf_counter() - started:7.1f}s] {task} seed {seed} {config:<22} "
                          f"rank-0 {100 * r['rank0']:.2f}%  consensus {100 * r['consensus']:.2f}%  "
                          f"distance {r['distance']:.1e}  ({r['seconds']:.1f}s)", flush=True)
    wall = time.perf_counter() - started
    if hvd.rank() == 0:
        summarize(results, args.seeds)
        print_tables(results, args.seeds, meta)
        print(f"\n{hvd.size()} ranks, racks {RACKS}, base lr {args.base_lr} per rank (x{hvd.size()}), "
              f"batch {args.batch_size} per rank, hidden {args.hidden}: {wall:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "racks": RACKS, "wall_seconds": wall, "tasks": meta,
                           "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
