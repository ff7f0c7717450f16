"""One rank of the PyTorch fidelity job: scripts written for hvd.DistributedOptimizer work unchanged.

Scenarios, in one job: Horovod's resume recipe (rank 0 alone loads a checkpoint, then
broadcast_optimizer_state), the GradScaler recipes with one rank's gradient overflowing, what is averaged
(buffers replaced by model.to(), frozen and untrained parameters left out), two overlapping optimizers,
Horovod's synchronize warning and attributes; last, ranks that drift one step apart must all raise a clear
error. Every check raises on failure, so a failing rank fails the launch.
"""
import warnings

import common
import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init()
import torch
from common import check, check_alike
from torch_semantics import rank_valued  # (this folder)

hvd.init()
RANK, SIZE = common.identify(hvd)
LAST = SIZE - 1


def user_unnamed_ops():
    """What a user script does between steps; hangs if DS-Sync's op count differed between ranks."""
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
    check(total.item() == SIZE, f"unnamed allreduce gave {total.item()}")


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_groups_agree(opt, step, tag):
    """Every rank averaged at ``step`` with the group the schedule gives it there, as all members say."""
    want = opt.schedule.group_of(RANK, step)
    check(opt.last_sync["group"] == want, f"{tag}: averaged with {opt.last_sync['group']} at step {step}, "
                                          f"the schedule says {want}")
    everyone = hvd.allgather_object((step, opt.last_sync["group"]), name=f"test.{tag}.groups")
    for r, (s, group) in enumerate(everyone):
        check(s == step and r in group and all(everyone[m][1] == group for m in group),
              f"{tag}: ranks disagree on their groups at step {step}: {everyone}")


def resume_recipe(momentum):
    """Horovod's recipe: rank 0 alone loads the checkpoint, then broadcasts parameters and optimizer state."""
    tag = f"resume-momentum{momentum}"
    kwargs = dict(num_groups=2 if SIZE > 2 else 1, seed=5, schedule_options={"window_steps": 2})
    torch.manual_seed(RANK)
    model = torch.nn.Linear(4, 3)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                   named_parameters=model.named_parameters(), **kwargs)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    checkpoint = opt.state_dict() if RANK == 0 else None

    model = torch.nn.Linear(4, 3)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                   named_parameters=model.named_parameters(), **kwargs)
    if RANK == 0:
        opt.load_state_dict(checkpoint)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in (5, 6, 7):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        check(opt.sync_step == step + 1, f"{tag}: sync_step {opt.sync_step} after step {step}")
        check_groups_agree(opt, step, tag)
        user_unnamed_ops()


def grad_scaler_recipe(unscale_first):
    """One rank's gradient overflows at a warm-up step and at a group step; every rank keeps going.

    With ``unscale_first``, Horovod's recipe: synchronize, unscale_, clip, step inside skip_synchronize.
    Without, ``scaler.step(opt)`` alone (the optimizer unscales). Before each step every rank computes the
    model its local update should give (its unchanged model if its gradient overflowed); after it, every
    rank's model must be the mean of those over its group: the overflowing rank took part.
    """
    tag = f"amp-unscale{unscale_first}"
    lr, overflow_at, warmup = 0.125, {0, 3}, 1
    model = rank_valued(torch.nn.Linear(3, 2), RANK)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # the warm-up starts from one model
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), num_groups=2 if SIZE > 2 else 1,
                                   seed=1, warmup_steps=warmup)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(6):
        opt.zero_grad()
        x = torch.full((4, 3), float(RANK + step + 1))
        scaler.scale(model(x).pow(2).mean()).backward()
        overflow = RANK == LAST and step in overflow_at
        if overflow:
            model.weight.grad[0, 0] = float("inf")
        scale = scaler.get_scale()
        if unscale_first:
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            grads = [p.grad.clone() for p in model.parameters()]
        else:
            grads = [p.grad / scale for p in model.parameters()]
            if step < warmup:  # the optimizer will average the gradients first
                grads = [hvd.allreduce(g, name=f"test.{tag}.grads.{i}") for i, g in enumerate(grads)]
        skipped = not all(torch.isfinite(g).all() for g in grads)
        local = flat(model) if skipped else flat(model) - lr * torch.cat([g.reshape(-1) for g in grads])
        everyone = hvd.allgather(local.unsqueeze(0), name=f"test.{tag}.local")
        if unscale_first:
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        check(not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf"),
              f"{tag}: GradScaler's attributes left on the optimizer")
        if step < warmup:
            check(skipped, f"{tag}: one rank overflowed in the warm-up, yet rank {RANK} stepped")
            want = local
        else:
            want = everyone[list(opt.schedule.group_of(RANK, step))].mean(0)
            check_groups_agree(opt, step, tag)
        check(torch.allclose(flat(model), want, rtol=1e-5, atol=1e-5),
              f"{tag} step {step} (overflow on rank {LAST}): model {flat(model).tolist()}, want the group mean "
              f"of the local updates {want.tolist()}")
        user_unnamed_ops()
    steps = hvd.allgather_object(opt.sync_step, name=f"test.{tag}.steps")
    check(steps == [6] * SIZE, f"{tag}: the ranks' steps differ after overflows: {steps}")


def what_is_averaged():
    """Buffers replaced after construction, frozen parameters, parameters the optimizer does not train."""
    model = rank_valued(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 2)),
                        RANK)
    model[2].weight.requires_grad_(False)
    trained = [p for name, p in model.named_parameters() if name != "2.bias"]  # and 2.weight is frozen
    opt = dss.DistributedOptimizer(torch.optim.SGD(trained, lr=0.0), named_parameters=model.named_parameters(),
                                   model=model, num_groups=1, seed=0)
    model.to(torch.float64)  # replaces every buffer; parameters keep their objects
    opt.step()
    mean = (SIZE - 1) / 2
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not tensor.is_floating_point():
            continue
        want = float(RANK) if name in ("2.weight", "2.bias") else mean
        check(torch.all(tensor == want), f"{name} holds {tensor.reshape(-1).tolist()}, want {want}")
    check(opt.last_sync["bytes_sent"] > 0 or SIZE == 1, f"nothing was averaged: {opt.last_sync}")


def one_rank_groups():
    model = rank_valued(torch.nn.Linear(3, 2), RANK)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), num_groups=SIZE, seed=0)
    opt.step()
    user_unnamed_ops()
    check(opt.last_sync["group"] == (RANK,) and opt.last_sync["bytes_sent"] == 0,
          f"a one-rank group recorded {opt.last_sync}")
    check(torch.all(flat(model) == RANK), "a one-rank group changed the model")


def two_overlapping_optimizers():
    """Two optimizers with averages in flight at once: their ops must not share a name."""
    models = [rank_valued(torch.nn.Linear(3, 2), RANK), rank_valued(torch.nn.Linear(2, 2), RANK * 10)]
    opts = [dss.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), named_parameters=m.named_parameters(),
                                     num_groups=1, seed=0, overlap=True) for m in models]
    for opt in opts:
        opt.step()
    for opt in opts:
        opt.finish_pending()
    for model, scale in zip(models, (1, 10)):
        check(torch.all(flat(model) == scale * (SIZE - 1) / 2), f"overlapping optimizers mixed up their averages: "
                                                                f"{flat(model).tolist()}")


def horovod_surface():
    """Horovod's synchronize warning, word for word, and the attributes scripts read."""
    model = torch.nn.Linear(3, 2)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), num_groups=1, warmup_steps=1)
    check(opt._parameter_names == {model.weight: "weight", model.bias: "bias"},
          f"_parameter_names {opt._parameter_names}")
    check(opt.op == hvd.Average and opt.gradient_predivide_factor == 1.0 and opt.sparse_as_dense is False
          and opt.process_set is hvd.global_process_set and opt.backward_passes_per_step == 1,
          "Horovod's attributes differ from the arguments")
    opt.set_backward_passes_per_step(2)
    check(opt.backward_passes_per_step == 2, "set_backward_passes_per_step had no effect")
    for step in range(2):  # a warm-up step, then a group step
        model(torch.randn(2, 3)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        messages = [str(w.message) for w in caught]
        check(any(m.startswith("optimizer.step() called without optimizer.skip_synchronize() context after "
                               "optimizer.synchronize().") for m in messages), f"step {step}: no warning: {messages}")
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with opt.skip_synchronize():
                opt.step()
        check(not caught, f"step {step}: warned inside skip_synchronize: {[str(w.message) for w in caught]}")


def drifted_ranks_fail_clearly():
    """Rank 0 alone goes back to an earlier checkpoint mid-run: at the next average every rank raises an error
    naming the ranks' steps.

    One group of all ranks, so that the drifted average still meets (a group recurring at two steps).
    Last in the job: only named ops follow.
    """
    model = rank_valued(torch.nn.Linear(3, 2), RANK)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), num_groups=1, seed=0)
    opt.step()
    saved = opt.state_dict()
    opt.step()
    opt.step()
    if RANK == 0:
        opt.load_state_dict(saved)
    error = None
    try:
        opt.step()
    except RuntimeError as e:
        error = str(e)
    check(error is not None, "ranks at different steps averaged without an error")
    want = "ranks of one group are at different DS-Sync steps: rank 0 at step 1, rank 1 at step 3"
    check(want in error, f"unexpected error: {error}")
    everyone = hvd.allgather_object(error, name="test.drift.errors")
    check_alike(everyone, f"ranks raised different errors: {everyone}")


def main():
    for momentum in (0.0, 0.9):  # stateless: broadcast_optimizer_state carries nothing at all
        resume_recipe(momentum)
    for unscale_first in (True, False):
        grad_scaler_recipe(unscale_first)
    what_is_averaged()
    one_rank_groups()
    two_overlapping_optimizers()
    horovod_surface()
    user_unnamed_ops()
    if SIZE > 1:
        drifted_ranks_fail_clearly()
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
