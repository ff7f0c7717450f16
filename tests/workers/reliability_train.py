"""One rank of a small deterministic DS-Sync training run, for the failure, checkpoint and elastic jobs.

Modes:
- ``kill --at K``: rank 1 kills itself (SIGKILL) at step K; the others train on until Horovod fails them.
- ``stall --at K``: rank 1 stops calling Horovod at step K (alive, but silent). With ``--through-racks`` (4
  ranks): the racks [[0, 1], [2, 3]] and their global averages through the racks; K is then the first of
  those at K or after.
- ``full --steps N --dir D``: train N steps, save each rank's weights at the end.
- ``save --steps K --dir D``: train K steps, save each rank's model and optimizer state (a checkpoint).
- ``resume --steps N --dir D``: load the checkpoint, train on to step N, compare bit for bit with ``full``.
- ``reshape --steps N --dir D``: the same on fewer ranks than saved it (each loads its rank's checkpoint):
  the schedule is the new world's and the step goes on; no bit comparison (other groups, other result).

Each rank's batch at step t is drawn from a generator seeded by (rank, t), so the data does not depend
on how the run was cut.
"""
import argparse
import os
import signal
import time

import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(): plain hvd.init() must allow process sets
import torch
from hvd_dssync.plan import SyncPlan

OPTIONS = dict(num_groups=2, seed=11, warmup_steps=2, global_every=5, schedule_options={"window_steps": 3})
THROUGH_RACKS = dict(schedule="topology", topology=[[0, 1], [2, 3]], seed=11, warmup_steps=2, average_every=4,
                     global_every=8, schedule_options={"intra_steps": None, "global_via_bridges": True})


def build(options=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), model=model,
                                   **(options or dict(OPTIONS, num_groups=min(2, hvd.size()))))
    return model, opt


def first_route_step(at):
    """The first step at ``at`` or after whose global average goes through the racks (``THROUGH_RACKS``)."""
    plan = SyncPlan(rank=hvd.rank(), world_size=hvd.size(), **THROUGH_RACKS)
    return next(t for t in range(at, at + 100) if plan.global_route(t) is not None)


def batch(step):
    generator = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(8, 6, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model, opt, step):
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def refuse_other_configuration(state, fragment):
    """A checkpoint from other DS-Sync arguments must not load silently: same world size, its schedule
    configuration differs; another world size, its arguments differ. ``fragment`` is the expected one."""
    model = torch.nn.Linear(6, 1)
    other = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters(), model=model,
                                     **dict(OPTIONS, num_groups=min(2, hvd.size()), seed=OPTIONS["seed"] + 1))
    try:
        other.load_state_dict(state)
    except ValueError as e:
        if fragment not in str(e) or "'seed': 12" not in str(e):
            raise
    else:
        raise AssertionError("a checkpoint saved with seed 11 loaded into an optimizer with seed 12")


def path(directory, what):
    return os.path.join(directory, f"{what}.rank{hvd.rank()}.pt")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("kill", "stall", "full", "save", "resume", "reshape"))
    parser.add_argument("--at", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dir")
    parser.add_argument("--through-racks", action="store_true")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    hvd.init()
    model, opt = build(THROUGH_RACKS if args.through_racks else None)
    if args.through_racks:
        args.at = first_route_step(args.at)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if args.mode in ("kill", "stall"):
        started = time.monotonic()
        for step in range(10 ** 6):
            if step == args.at and hvd.rank() == 1:
                print(f"rank 1: {args.mode} at step {step}", flush=True)
                if args.mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            if step == args.at:
                started = time.monotonic()
            try:
                train_step(model, opt, step)
            except Exception as e:
                print(f"rank {hvd.rank()}: stopped {time.monotonic() - started:.1f}s after rank 1 failed, "
                      f"at step {step}: {type(e).__name__}: {e}", flush=True)
                raise
            time.sleep(0.01)
        return
    start = 0
    if args.mode in ("resume", "reshape"):
        checkpoint = torch.load(path(args.dir, "checkpoint"))
        refuse_other_configuration(checkpoint["optimizer"], "the checkpoint's DS-Sync configuration"
                                   if args.mode == "resume" else "the checkpoint's DS-Sync arguments")
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        start = opt.sync_step
    for step in range(start, args.steps):
        train_step(model, opt, step)
    if args.mode == "save":
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path(args.dir, "checkpoint"))
    elif args.mode == "full":
        torch.save(model.state_dict(), path(args.dir, "full"))
    elif args.mode == "reshape":
        if opt.schedule.world_size != hvd.size() or opt.sync_step != args.steps:
            raise AssertionError(f"rank {hvd.rank()}: after resuming a checkpoint of another world, schedule "
                                 f"for {opt.schedule.world_size} ranks in a world of {hvd.size()}, step "
                                 f"{opt.sync_step} (want {args.steps})")
        print(f"rank {hvd.rank()}: resumed at step {start} in a world of {hvd.size()}, trained on to step "
              f"{args.steps}", flush=True)
    else:
        full = torch.load(path(args.dir, "full"))
        for name, tensor in model.state_dict().items():
            if not torch.equal(tensor, full[name]):
                raise AssertionError(f"rank {hvd.rank()}: {name} after resuming at step {start} differs from "
                                     f"the uninterrupted run by {(tensor - full[name]).abs().max().item()}")
        print(f"rank {hvd.rank()}: resumed at step {start}, equal to the uninterrupted run at step "
              f"{args.steps}", flush=True)
    # Ranks in other groups may still be averaging: a rank that exited now would shut Horovod down
    # under them. A global collective last, as every DS-Sync script should.
    hvd.barrier()
    print(f"rank {hvd.rank()}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
