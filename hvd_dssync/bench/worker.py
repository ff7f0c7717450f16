"""One rank of one contender: ``python -m hvd_dssync.bench.worker '<json config>'``.

The same workload for every contender: an MLP on the task's data set (:mod:`hvd_dssync.bench.metric`;
each rank trains on its own shard), SGD with momentum, a fixed number of steps bounded by a training-time
budget. Rank 0 times every step; every rank copies its model every few steps, off the training clock
(:class:`~hvd_dssync.bench.metric.Snapshots`; the bench evaluates rank 0's and the consensus model from them
after the job), and at the end rank 0 evaluates the global average of the models; it writes the record to
``config["out"]``.

The training loop prints ``MARK start`` and ``MARK end`` (after a barrier each) so that the launcher can
read the bottleneck's byte counters around exactly the training steps. Under ``config["stragglers"]``
the rank that :func:`~hvd_dssync.bench.scenarios.slow_rank` names sleeps ``delay`` seconds more in
each of its steps (after the backward pass, before the optimizer's communication).
"""
import json
import os
import socket
import sys
import time
import warnings

import numpy as np

from hvd_dssync.bench.catalog import (ALONE, CONTENDERS, DEFAULT, DEFAULT_ARGUMENTS, DEFAULT_VARIANTS, DYNAMIC_SETS,
                                      FP16, HOROVOD_BSP, IDLE_SETS, OUTER_MOMENTUM, OVERLAP, POLICY, POSTLOCAL, TRIAL,
                                      build_model, dssync_arguments, period_of)
from hvd_dssync.bench.metric import SNAPSHOT_BUDGET_BYTES, Snapshots, load_data, snapshot_every
from hvd_dssync.bench.scenarios import slow_rank
from hvd_dssync.topology import loopback_hostname_warning

__all__ = ["main", "postlocal_optimizer", "StopSignal", "run"]

# Steps that every rank trains on after rank 0's budget ran out (see StopSignal); one for the contenders
# that allreduce every step.
STOP_MARGIN = 24
_SETTLE_SECONDS = 0.5  # after "MARK end", before the final averaging, so the counters are read first


def warn_if_hostname_is_loopback():
    """Warn where a multi-host job's hostname resolves to loopback (see ``loopback_hostname_warning``)."""
    message = loopback_hostname_warning(int(os.environ.get("HOROVOD_CROSS_SIZE", "1")))
    if message:
        warnings.warn(message)
    return message is not None


class Comm:
    """The few collectives the loop needs, from Horovod or torch.distributed."""

    def __init__(self, kind):
        self.kind = kind

    def max_flag(self, value):
        import torch

        t = torch.tensor([float(value)])
        if self.kind == "horovod":
            import horovod.torch as hvd
            return float(hvd.allreduce(t, op=hvd.Max, name="bench.flag")[0])
        import torch.distributed as dist
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def average_model(self, model):
        if self.kind == "horovod":
            import hvd_dssync.torch as dss
            dss.synchronize_models(model)
            return
        import torch
        import torch.distributed as dist
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.data)
                p.data /= dist.get_world_size()


def _make_contender(name, model, config, rank, size):
    """(model to call, optimizer, Comm, function of the last step's (kind, sync seconds), or None)."""
    import torch

    lr, momentum = config["lr"], config["momentum"]
    racks = config["racks"]
    warmup = config.get("warmup_steps", 0)
    if name.startswith("dssync-") or name in HOROVOD_BSP:
        import horovod.torch as hvd
        import hvd_dssync.torch as dss
        from hvd_dssync.adaptive import AdaptivePolicy

        if name in HOROVOD_BSP:
            hvd.init()
            if name == "horovod-hierarchical" and not hvd.mpi_enabled():
                raise RuntimeError("horovod-hierarchical runs under mpirun with Horovod's MPI controller and "
                                   "operations (Open MPI's coll/han does its hierarchy); this job is not an MPI one")
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                           named_parameters=model.named_parameters())
            sync = None
        elif name == DEFAULT or name in DEFAULT_VARIANTS or name in DEFAULT_ARGUMENTS:
            hvd.init()  # importing hvd_dssync.torch enabled dynamic process sets
            base = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            opt = dss.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           **DEFAULT_ARGUMENTS.get(name, {}))
            sync = lambda: (opt.last_sync["kind"], opt.last_sync.get("seconds", 0.0))  # noqa: E731
        else:
            kwargs = dssync_arguments(name, config)
            if name in DYNAMIC_SETS:
                hvd.init()
            else:
                registered = dssync_arguments(IDLE_SETS.get(name, name), config)
                dss.init(seed=config["seed"], **{k: v for k, v in registered.items()
                                                  if k not in ("average_every", "global_every")})
            base = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            opt = dss.DistributedOptimizer(base, named_parameters=model.named_parameters(), model=model,
                                           seed=config["seed"], warmup_steps=warmup,
                                           outer_momentum=OUTER_MOMENTUM.get(name, 0.0),
                                           overlap=None if name in TRIAL else name in OVERLAP,
                                           policy=AdaptivePolicy(**POLICY[name]) if name in POLICY else None,
                                           compression=hvd.Compression.fp16 if name in FP16 else
                                           hvd.Compression.none, **kwargs)
            sync = lambda: (opt.last_sync["kind"], opt.last_sync.get("seconds", 0.0))  # noqa: E731
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, opt, Comm("horovod"), sync

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=size)
    if name == ALONE:
        return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), Comm("torch"), None
    ddp = DistributedDataParallel(model)
    base = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    if name == "ddp":
        return ddp, base, Comm("torch"), None
    return ddp, postlocal_optimizer(name, ddp, base, period_of(name, config), racks, size, warmup), Comm("torch"), None


def postlocal_optimizer(name, ddp, base, period, racks, size, warmup=0):
    """PyTorch's post-local SGD for contender ``name`` ("postlocal-periodic..." or "postlocal-hierarchical..."):
    ``ddp`` (a ``DistributedDataParallel`` of the model) allreduces gradients during the ``warmup`` steps only,
    then ``base`` steps locally and PyTorch's averager averages the models: every ``period`` steps
    (periodic), or the rack every ``period // 2`` and every rank every ``2 period`` (hierarchical; racks of
    equal size, else all every ``2 period`` alone). The bench and ``hvd_dssync/bench/experiments/parity.py`` build it alike."""
    from collections import OrderedDict

    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    ddp.register_comm_hook(PostLocalSGDState(None, None, warmup, post_local_gradient_allreduce=False),
                           post_localSGD_hook)
    if name.startswith("postlocal-periodic"):
        averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    else:
        rack_size = racks and len(racks[0])
        periods = OrderedDict()
        if 1 < rack_size < size and all(len(r) == rack_size for r in racks):
            periods[max(1, period // 2)] = rack_size
        periods[period * 2] = size
        averager = HierarchicalModelAverager(periods, warmup_steps=warmup)
    return PostLocalSGDOptimizer(base, averager)


class StopSignal:
    """How rank 0 tells the others to stop, without a collective: a barrier in the loop would make every
    rank wait for the slowest at each check, outside the training clock, and hide a straggler from the
    group schedules' clocks (their ranks otherwise wait only for their groups).

    Rank 0, out of its time budget, writes the step every rank stops before: ``margin`` steps on from its
    own, so that the ranks ahead of it (by at most a few averaging periods: each waits for its group,
    the groups for one another) have not passed it. Every rank reads the file before each step (all of
    them run on this machine). A rank already past the step cannot stop with the others: it raises.
    """

    def __init__(self, path, rank, margin):
        self.path, self.rank, self.margin, self.at = path, rank, margin, None

    def announce(self, step):
        if self.at is None:
            self.at = step + 1 + self.margin
            with open(self.path + ".tmp", "w") as f:
                f.write(str(self.at))
            os.replace(self.path + ".tmp", self.path)

    def now(self, step):
        """Whether to stop before ``step``."""
        if self.at is None and os.path.exists(self.path):
            with open(self.path) as f:
                self.at = int(f.read())
        if self.at is not None and step > self.at:
            raise RuntimeError(f"rank {self.rank} reached step {step} before it read the stop step {self.at}: "
                               f"raise the bench's stop margin ({self.margin} steps)")
        return step == self.at


def evaluate(model, x, y):
    import torch

    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(1) == y).float().mean().item()
    return loss, accuracy


def run(config):
    import faulthandler

    import torch

    # A rank stuck in a collective dumps its stack and exits before the launcher's timeout kills it.
    faulthandler.dump_traceback_later(config.get("hang_seconds", 120), exit=True)

    torch.set_num_threads(1)
    rank, size = config["rank"], config["size"]
    name = config["contender"]
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; one of {', '.join(CONTENDERS)}")
    os.environ.update(DEFAULT_VARIANTS.get(name, {}))  # read by Horovod's background thread and the optimizer
    warn_if_hostname_is_loopback()
    x_train, y_train, x_test, y_test = load_data(config["seed"], config.get("task", "synthetic"))
    x_train, y_train = torch.from_numpy(x_train[rank::size]), torch.from_numpy(y_train[rank::size])
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)
    model = build_model(config["hidden"], config["seed"])
    params = sum(p.numel() for p in model.parameters())
    batch = config["batch"]
    rng = np.random.default_rng(config["seed"] * 1000 + rank)

    def batches():
        while True:
            order = torch.from_numpy(rng.permutation(len(y_train)))
            for start in range(0, len(order) - batch + 1, batch):
                yield order[start:start + batch]

    data = batches()
    loss_fn = torch.nn.CrossEntropyLoss()

    # Compute alone, before any communication: what a step costs without synchronization.
    calib_model = build_model(config["hidden"], config["seed"])
    calib_opt = torch.optim.SGD(calib_model.parameters(), lr=0.0, momentum=config["momentum"])
    calib = []
    for _ in range(config["calibration_steps"]):
        idx = next(data)
        started = time.perf_counter()
        calib_opt.zero_grad()
        loss_fn(calib_model(x_train[idx]), y_train[idx]).backward()
        calib_opt.step()
        calib.append(time.perf_counter() - started)
    compute_seconds = float(np.median(calib)) if calib else 0.0

    net, opt, comm, last_sync = _make_contender(name, model, config, rank, size)
    stragglers = config.get("stragglers")
    every, dtype = snapshot_every(params, config["steps"], config["eval_every"],
                                  config.get("snapshot_budget_bytes", SNAPSHOT_BUDGET_BYTES))
    snapshots = Snapshots(model, every, dtype)
    # A copy taken with an average in flight is read as an evaluation reads it: the average folded in.
    folds = hasattr(opt, "register_fold_hook") and not OUTER_MOMENTUM.get(name)
    if folds:
        opt.register_fold_hook(snapshots.fold)
    compute_wait = config.get("compute_ms", 0.0) / 1e3  # an accelerator's compute, emulated: the CPU stays free
    comm.max_flag(0)
    if rank == 0:
        print("MARK start", flush=True)
    # The straggler timetable runs on wall time from here: the barrier just above started every rank
    # together, and a slow host stays slow whatever training does meanwhile.
    training_started = time.perf_counter()
    step_times, sync_times, curve, losses = [], [], [], []
    kinds, kind_of_step, slowed_seconds, decisions = {}, [], 0.0, []
    train_clock = 0.0
    loss_value = float("nan")
    margin = 1 if name in (*HOROVOD_BSP, "ddp") else STOP_MARGIN  # every step of theirs waits for every rank
    stop = StopSignal(config["out"] + ".stop", rank, config.get("stop_margin", margin))
    # The default's trial of overlap: opt.overlap is None until it decides; the steps through the deciding one.
    on_trial, trial_steps = getattr(opt, "overlap", False) is None, None
    for step in range(config["steps"]):
        if stop.now(step):
            break
        idx = next(data)
        started = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(net(x_train[idx]), y_train[idx])
        loss.backward()
        if compute_wait:
            time.sleep(compute_wait)
        if stragglers and slow_rank(stragglers, started - training_started, config["seed"], size) == rank:
            # A slow host's compute: sleeping leaves the shared cores to the other ranks.
            time.sleep(stragglers["delay"])
            slowed_seconds += stragglers["delay"]
        folding = snapshots.seconds
        opt.step()
        elapsed = time.perf_counter() - started - (snapshots.seconds - folding)  # the copies' fold: off the clock
        loss_value = loss.item()
        losses.append(loss_value)
        step_times.append(elapsed)
        if on_trial and getattr(opt, "overlap", None) is not None:
            on_trial, trial_steps = False, step + 1
        if last_sync:
            kind, seconds = last_sync()
            kinds[kind] = kinds.get(kind, 0) + 1
            kind_of_step.append(kind)
            sync_times.append(seconds)
            decision = (getattr(opt, "last_sync", None) or {}).get("decision")
            if decision is not None and (not decisions or decisions[-1]["step"] != decision["step"]):
                decisions.append(dict(decision, time=train_clock + elapsed))  # the adaptive policy's
        else:
            sync_times.append(max(0.0, elapsed - compute_seconds))
        train_clock += elapsed
        snapshots.stamp(train_clock)
        last = step == config["steps"] - 1
        if snapshots.due(step + 1) or last:
            # Off the clock: evaluated by the bench after the job.
            snapshots.take(step + 1, train_clock, folds and opt.in_flight)
            curve.append({"step": step + 1, "time": train_clock, "train_loss": float(np.mean(losses))})
            losses = []
            if rank == 0 and train_clock > config["max_train_seconds"]:
                stop.announce(step)
    if folds and opt.in_flight:
        opt.finish_pending()  # the last copies, as an evaluation after training reads them
        snapshots.stamp(train_clock)
    comm.max_flag(0)
    if rank == 0:
        print("MARK end", flush=True)
    time.sleep(_SETTLE_SECONDS)
    snapshots.write(f"{config['out']}.rank{rank}.npz")
    local_loss, local_accuracy = evaluate(model, x_test, y_test)
    comm.average_model(model)
    final_loss, final_accuracy = evaluate(model, x_test, y_test)
    record = {
        "contender": name, "rank": rank, "size": size, "parameters": params, "model_bytes": params * 4,
        "steps": len(step_times), "train_seconds": train_clock, "compute_seconds": compute_seconds,
        "step_times": step_times, "sync_times": sync_times, "curve": curve,
        "local_accuracy": local_accuracy, "final_loss": final_loss, "final_accuracy": final_accuracy,
        "batch": batch, "hostname_loopback": socket.gethostbyname(socket.gethostname()).startswith("127."),
        "step_kinds": kinds, "kind_of_step": kind_of_step, "slowed_seconds": slowed_seconds,
        "decisions": decisions, "sensed": getattr(opt, "sensed", None), "overlap": getattr(opt, "overlap", None),
        "overlap_trial": getattr(opt, "overlap_trial", None), "trial_steps": trial_steps,
        "task": config.get("task", "synthetic"), "snapshot_every": every, "snapshot_dtype": dtype,
    }
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump(record, f)
    if name in ("ddp", ALONE) or name in POSTLOCAL:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
        # The record is written and the group destroyed: leave without freeing the model's
        # DistributedDataParallel. Once (4 ranks on loopback), rank 0 blocked in that clean-up for minutes
        # after run() had returned, in no Python frame, until the fault handler ended it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        import horovod.torch as hvd
        hvd.shutdown()
    return record


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config = json.loads(argv[0])
    for key in ("rank", "size"):
        if key not in config:
            config[key] = int(os.environ.get(f"HOROVOD_{key.upper()}", os.environ.get(key.upper(), 0) or 0))
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
