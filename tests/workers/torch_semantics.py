"""One rank of the PyTorch semantics job: group means, schedule agreement, sync, drop-in, policies.

Every check raises on failure, so a failing rank exits non-zero and fails the launch. Unnamed Horovod ops
are interleaved with the DS-Sync steps throughout, as a user script would have them.
"""
import argparse
import os

import common
import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(): plain hvd.init() must allow process sets
import torch
from common import behaviour, check, check_alike, check_idle_loop, expected_values, fail
from hvd_dssync import SyncConfig, horovod_loop

RANK = SIZE = None


def user_unnamed_ops():
    """What a user script does between steps; hangs if DS-Sync's op sequence differed between ranks."""
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
    check(total.item() == SIZE, f"unnamed allreduce gave {total.item()}")
    gathered = hvd.allgather(torch.tensor([RANK]))
    check(gathered.tolist() == list(range(SIZE)), f"unnamed allgather gave {gathered.tolist()}")


def rank_valued(module, value):
    """``module`` with every parameter and floating-point buffer set to ``value`` (PyTorch workers share it)."""
    with torch.no_grad():
        for t in list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]:
            t.fill_(float(value))
    return module


def rank_valued_model(with_batchnorm=False):
    layers = [torch.nn.Linear(3, 2)]
    if with_batchnorm:
        layers.append(torch.nn.BatchNorm1d(2))
    return rank_valued(torch.nn.Sequential(*layers), RANK)


def one_backward(model):
    model.zero_grad()
    model(torch.randn(4, 3)).sum().backward()


def check_group_means(schedule_name, overlap=False, **kwargs):
    model = rank_valued_model(with_batchnorm=True)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), model=model,
                                   schedule=schedule_name, seed=7, overlap=overlap, **kwargs)
    steps = 9
    history = expected_values(opt._plan, SIZE, steps, overlap)
    model.eval()  # BatchNorm must not update its statistics in the forward pass here
    for t in range(steps):
        one_backward(model)
        opt.step()
        user_unnamed_ops()
        want = history[t][RANK]
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point():
                got = tensor.detach().reshape(-1)
                check(torch.allclose(got, torch.full_like(got, want), atol=1e-6),
                      f"{schedule_name} step {t}: {name} holds {got.tolist()}, want the group mean {want}")
    check(opt.sync_step == steps, f"sync_step {opt.sync_step} != {steps}")
    # Every rank reports the same groups.
    mine = [opt.schedule.groups(t) for t in range(12)]
    everyone = hvd.allgather_object(mine, name=f"test.groups.{schedule_name}")
    check_alike(everyone, f"ranks disagree on schedule.groups: {everyone}")
    if SIZE >= 3 and schedule_name == "shuffle":
        check(len(set(mine)) > 1, f"the shuffle never changed its groups: {mine}")
    return model, opt


def check_default_on_racks():
    """The default schedule on racks given (none named), every 2 steps and every rank every 4: the racks meet
    only in the global averages, sent through them (``global_via_bridges="auto"``, nothing in the way)."""
    _, opt = check_group_means(None, topology=halves(SIZE), average_every=2, global_every=4)
    schedule = opt.schedule
    kind = (type(schedule).__name__, schedule.intra_steps, schedule.global_via_bridges)
    check(kind == ("TopologyAware", None, "auto"), f"the default on racks is {schedule!r}")
    check(SIZE == 1 or opt._plan.global_route(3) is not None, "step 3's global average is not through the racks")


def check_synchronize_models():
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    torch.manual_seed(RANK)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), model=model,
                                   num_groups=min(2, SIZE), seed=1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(6, 5)).pow(2).mean().backward()
        opt.step()
        user_unnamed_ops()
    before = dss.consensus_distance(model)
    everyone = hvd.allgather_object(before, name="test.distance.before")
    check_alike(everyone, f"consensus_distance differs between ranks: {everyone}")
    if SIZE > 1:
        check(before > 0, f"models trained on different data should differ, distance {before}")
    dss.synchronize_models(model)
    flat = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values() if t.is_floating_point()])
    rows = hvd.allgather(flat.unsqueeze(0), name="test.sync.weights")
    common.check_consensus(rows, torch.equal, dss.consensus_distance(model), "synchronize_models")


def check_drop_in():
    model = torch.nn.Linear(4, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt, warned = common.horovod_argument_warnings(lambda: dss.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), compression=hvd.Compression.none, backward_passes_per_step=2,
        op=hvd.Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
        process_set=hvd.global_process_set, num_groups=1, seed=3))
    check(len(warned) == 1, f"Horovod's num_groups gave {len(warned)} HorovodArgumentWarning(s)")
    check(isinstance(opt, torch.optim.SGD), "the optimizer is no longer an SGD")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    check(opt.sync_step == 0, f"broadcast_optimizer_state advanced the schedule to {opt.sync_step}")
    for _ in range(2):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    check(abs(opt.param_groups[0]["lr"] - 0.125) < 1e-12, f"StepLR left lr {opt.param_groups[0]['lr']}")
    state = opt.state_dict()
    other, warned = common.horovod_argument_warnings(lambda: dss.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), named_parameters=model.named_parameters(),
        sync=SyncConfig(num_groups=1, seed=3)))
    check(not warned, f"DS-Sync's num_groups through sync= warned {[str(w.message) for w in warned]}")
    other.load_state_dict(state)
    check(other.sync_step == 2, f"load_state_dict restored sync_step {other.sync_step}, want 2")
    check(other.param_groups[0]["lr"] == opt.param_groups[0]["lr"], "load_state_dict lost the lr")
    fp16 = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                    named_parameters=model.named_parameters(),
                                    compression=hvd.Compression.fp16, num_groups=1)
    model(torch.randn(3, 4)).sum().backward()
    fp16.step()
    check(dss.consensus_distance(model) < 1e-2, "fp16-compressed global average left the models apart")


def check_outer_momentum(beta=0.5, lr=0.1, steps=6):
    """Global averages every 2nd step with an outer momentum: heavy ball on the averaged model's change.

    Rank r's gradient is r + 1 (a linear loss), so the averaged model moves by -lr * H * mean(r + 1) per
    average of H = 2 steps; after the first average, the outer step turns those changes d into
    m <- beta m + d, x <- x + m. Checked on every rank, every step, and through a checkpoint.
    """
    weight = torch.nn.Parameter(torch.zeros(3))
    opt = dss.DistributedOptimizer(torch.optim.SGD([weight], lr=lr), named_parameters=[("w", weight)],
                                   num_groups=1, average_every=2, outer_momentum=beta)
    mean_gradient = sum(r + 1 for r in range(SIZE)) / SIZE
    x, local, momentum, started = 0.0, 0.0, 0.0, False
    for t in range(steps):
        opt.zero_grad()
        (weight.sum() * (RANK + 1)).backward()
        opt.step()
        local -= lr * (RANK + 1)
        if t % 2 == 1:  # an average: every rank's model becomes x - lr * 2 * mean_gradient
            averaged = x - lr * 2 * mean_gradient
            if started:
                momentum = beta * momentum + (averaged - x)
                averaged = x + momentum
            x, local, started = averaged, averaged, True
        check(torch.allclose(weight.detach(), torch.full((3,), local), atol=1e-5),
              f"outer momentum step {t}: {weight.tolist()}, want {local}")
    check("outer" in opt.state_dict()["dssync"], "the outer step's state is not in the checkpoint")
    try:
        dss.DistributedOptimizer(torch.optim.SGD([weight], lr=lr), named_parameters=[("w", weight)],
                                 outer_momentum=1.0)
    except ValueError as e:
        check("``outer_momentum``" in str(e), f"outer_momentum=1.0 gave {e}")
    else:
        fail("outer_momentum=1.0 was accepted")


def check_policies():
    model = rank_valued_model()
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), num_groups=SIZE, seed=0,
                                   global_every=3)
    mean = (SIZE - 1) / 2
    for t in range(3):
        one_backward(model)
        opt.step()
        user_unnamed_ops()
        value = model[0].weight.detach().reshape(-1)[0].item()
        want = mean if t == 2 else float(RANK)  # singleton groups leave values alone until step 3
        check(abs(value - want) < 1e-6, f"global_every=3 step {t}: value {value}, want {want}")
    torch.manual_seed(100 + RANK)
    model = torch.nn.Linear(3, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), num_groups=SIZE, seed=0,
                                   warmup_steps=3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        user_unnamed_ops()
    distance = dss.consensus_distance(model)
    check(distance < 1e-6, f"bulk-synchronous warm-up let the models drift apart: {distance}")
    check(opt.last_sync["kind"] == "bsp", f"warm-up step recorded as {opt.last_sync}")


ROTATING = {"intra_steps": 1, "rotate_every": 2}


def halves(size):
    return [[r for r in range(size) if r < (size + 1) // 2], [r for r in range(size) if r >= (size + 1) // 2]]


def check_static_topology():
    check(os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("0", ""),
          "dss.init left Horovod's dynamic process sets on for a topology schedule whose windows repeat")
    model, opt = check_group_means("topology", topology=halves(SIZE), schedule_options=ROTATING)
    # Racks at step 0, the exact bridge at 1, racks at 2: every rank holds the mean of all ranks' start values.
    mean = (SIZE - 1) / 2
    history = common.expected_values(opt._plan, SIZE, 3)
    check(abs(history[2][RANK] - mean) < 1e-9, f"the bridge's model after the racks' average: {history[2]}")
    check(len({opt.schedule.groups(t) for t in range(9)}) > 2, "the bridges never rotated in 9 steps")
    used = {opt._scope.to_global(g) for t in range(9) for g in opt.schedule.groups(t) if len(g) < SIZE}
    registry = opt._registry
    check(used <= registry._static, f"groups {sorted(used - registry._static)} were not registered statically")


def init(how):
    global RANK, SIZE
    if how == "mpi4py":
        from mpi4py import MPI

        hvd.init(comm=MPI.COMM_WORLD)
    elif how == "static":
        # Static process sets for a schedule with fixed groups; the checks then use only those groups.
        dss.init(schedule="butterfly")
    elif how == "static-topology":
        # Static process sets for every window of a schedule whose bridges rotate.
        dss.init(schedule="topology", topology=halves(common.launcher_size()), schedule_options=ROTATING)
    else:
        hvd.init()
    RANK, SIZE = common.identify(hvd)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", choices=("plain", "mpi4py", "static", "static-topology"), default="plain")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    init(args.init)
    num_groups = 2 if SIZE > 1 else 1
    if args.init == "static-topology":
        checks = [("static process sets, rotating bridges", check_static_topology)]
    elif args.init == "static":
        checks = [("group means, butterfly", lambda: check_group_means("butterfly")),
                  ("group means, butterfly, global every 2", lambda: check_group_means("butterfly", global_every=2))]
    else:
        checks = [
            ("group means, shuffle", lambda: check_group_means("shuffle", num_groups=num_groups)),
            ("group means, shuffle, windows of 2 steps",
             lambda: check_group_means("shuffle", num_groups=num_groups, schedule_options={"window_steps": 2})),
            ("group means, butterfly", lambda: check_group_means("butterfly")),
        ]
        if not args.quick:
            checks += [
                ("group means, shuffle, overlap",
                 lambda: check_group_means("shuffle", overlap=True, num_groups=num_groups)),
                ("group means, topology", lambda: check_group_means("topology", topology=halves(SIZE),
                                                                    schedule_options=ROTATING)),
                ("group means, topology, overlap", lambda: check_group_means("topology", overlap=True,
                                                                             topology=halves(SIZE),
                                                                             schedule_options=ROTATING)),
                # Every third step a global average through the racks (rack, speakers, rack): the mean of all.
                ("group means, topology, global averages through the racks",
                 lambda: check_group_means("topology", topology=halves(SIZE), global_every=3,
                                           schedule_options=dict(ROTATING, global_via_bridges=True))),
                ("group means, racks meeting only in global averages through them",
                 lambda: check_group_means("topology", topology=halves(SIZE), global_every=4,
                                           schedule_options={"intra_steps": None, "global_via_bridges": True})),
                # The default on racks (no schedule named): the racks meet only in global averages, sent
                # through them where nothing stands in the way (global_via_bridges="auto").
                ("group means, the default on racks", check_default_on_racks),
                ("synchronize_models", check_synchronize_models),
                ("drop-in arguments", check_drop_in),
                ("policies", check_policies),
                ("outer momentum", check_outer_momentum),
            ]
    checks.append(("Horovod's loop idle between averages", lambda: check_idle_loop(horovod_loop)))
    checks.append(("a script's unnamed ops after DS-Sync's", user_unnamed_ops))
    for name, run_checks in checks:
        with behaviour(name):
            run_checks()
    print(f"rank {RANK}: all checks passed", flush=True)

if __name__ == "__main__":
    main()
