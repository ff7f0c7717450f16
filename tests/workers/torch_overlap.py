"""One rank of the overlap job (4 ranks, one host): a stale average is folded in exactly, and one host runs no
trial of overlap (tests/workers/torch_overlap_hosts.py runs it across hosts).

Each rank's gradient is a constant of its own (the loss ``(w * c).sum()`` with ``c = rank + 1``), so that a
local step moves ``w`` by ``-lr * c`` whatever ``w`` is. Every average, waited for or folded in late as
``model += average - sent``, keeps the mean of the ranks' models; after ``synchronize_models`` every rank
must hold the mean of what each rank computed, ``-lr * steps * mean(c)``, whichever average was still in
flight. The mean alone cannot tell what an exact bridge sent (a bridge keeps the sum whatever it sends), so
with an average at every step (each folded in at the next, a fixed timing) every rank's weights are also
checked against a reference of overlapped averaging. Usage: torch_overlap.py
"""
import os

import common
import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch
from common import behaviour, check, overlapped_reference
from hvd_dssync.fragments import FRAGMENTS_ENV
from hvd_dssync.overlap import OverlapTrial
from hvd_dssync.plan import SyncPlan

hvd.init()
RANK, SIZE = common.identify(hvd)
LR = 0.125  # a power of two: float32 sums stay exact


def train(steps, **kwargs):
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), model=model, **kwargs)
    c = torch.full((1, 3), float(RANK + 1))
    kinds, in_flight = [], []
    for _ in range(steps):
        opt.zero_grad()
        (model.weight * c).sum().backward()
        opt.step()
        kinds.append((opt.last_sync or {}).get("kind"))  # None: nothing folded in yet
        in_flight.append(opt.in_flight)
    return model, opt, kinds, in_flight


def computed_mean(steps):
    """The mean of what the ranks computed in ``steps`` steps, which every average keeps."""
    return -LR * steps * sum(r + 1 for r in range(SIZE)) / SIZE


def holds(model, value):
    """Whether every weight of ``model`` is ``value`` (to float32's rounding)."""
    got = model.weight.detach().reshape(-1)
    return torch.allclose(got, torch.full_like(got, value), atol=1e-5)


def check_stale_fold_is_exact(steps, **kwargs):
    model, opt, kinds, in_flight = train(steps, overlap=True, **kwargs)
    check("group" in kinds and "local" in kinds, f"kinds {kinds}")
    if kwargs.get("global_every"):  # the global averages ran behind the steps too, folded in at the next step
        plan = SyncPlan(rank=RANK, world_size=SIZE, **kwargs)
        globals_at = [t for t in range(steps - 1) if plan.action(t).kind == "global"]
        waited = [t for t in globals_at if not in_flight[t]]
        late = [t for t in globals_at if kinds[t + 1] != "global"]
        check(globals_at and not waited and not late, f"kinds {kinds}; global averages at steps {globals_at}, "
              f"waited for at {waited}, not folded in at the next step at {late}")
    dss.synchronize_models(model)
    want = computed_mean(steps)
    check(holds(model, want), f"{kwargs}: after synchronize_models {model.weight.detach().reshape(-1).tolist()}, "
          f"want the mean of what the ranks computed {want}")


def check_folds_told(model, opt, kinds, steps, after_step=lambda step: None):
    """Steps 1 to ``steps - 1`` with a fold hook (``after_step(step)`` after each, its kind added to ``kinds``):
    each step moves the model by its local step (``-lr * c``) plus what the hooks were told its folds added."""
    told, moved = [], []  # each step's: what the hooks were told its folds added; what it moved beyond -lr * c
    opt.register_fold_hook(lambda moves: told[-1].add_(dict(moves)["weight"]))
    c = torch.full((1, 3), float(RANK + 1))
    for step in range(1, steps):
        before = model.weight.detach().clone()
        told.append(torch.zeros(1, 3))
        opt.zero_grad()
        (model.weight * c).sum().backward()
        opt.step()
        kinds.append((opt.last_sync or {}).get("kind"))
        moved.append(model.weight.detach() - before + LR * c)
        after_step(step)
    check(any(m.abs().sum() > 0 for m in moved) and all(torch.allclose(t, m, atol=1e-5) for t, m in zip(told, moved)),
          f"the fold hooks told {[t.tolist() for t in told]}; the steps moved the model by "
          f"{[m.tolist() for m in moved]} beyond their local steps")


def check_bridge_sends_the_racks_average(steps):
    """Racks then an exact bridge at every step: a bridge sends the rack's average, not a model that also
    holds the local step taken before the rack's average was folded in. Every step moves the model by its
    local step (``-lr * c``) and what the fold hooks are told its fold added (nothing where the rank sits a
    bridge out, alone): the exact bridges' folds (their moves, before the carry is scaled) as the racks'."""
    options = common.BRIDGE_EVERY_STEP
    model, opt, kinds, _ = train(1, overlap=True, **options)
    check_folds_told(model, opt, kinds, steps)
    check(kinds[0] is None and set(kinds[1:]) == {"group"}, f"kinds {kinds}")
    plan = SyncPlan(rank=RANK, world_size=SIZE, **options)
    want = overlapped_reference(plan, SIZE, steps, LR)[0][-1]
    got = hvd.allgather(model.weight.detach()[:, :1].reshape(1)).tolist()
    check(all(abs(g - w) < 1e-5 for g, w in zip(got, want)), f"weights {got}, want {want}")
    dss.synchronize_models(model)


def check_evaluation_folds_the_average_in_flight(steps):
    """Evaluating the model (``model.eval()`` under ``torch.no_grad()``) folds in the average in flight first, on
    the evaluating rank alone: rank 0's model is then the mean of what the ranks computed (an average at every
    step, so no local progress since it was sent); a forward pass that may train leaves it in flight."""
    model, opt, _, _ = train(steps, overlap=True, average_every=1, schedule="shuffle", num_groups=1)
    want = computed_mean(steps)
    check(opt.in_flight and not holds(model, want),
          f"before evaluating: in flight {opt.in_flight}, weights {model.weight.detach().reshape(-1).tolist()} "
          f"(the mean {want})")
    if RANK == 0:
        model(torch.ones(1, 3))
        check(opt.in_flight, "a forward pass in training mode folded the average in")
        model.eval()
        model(torch.ones(1, 3))
        check(opt.in_flight, "a forward pass in eval mode with gradients (frozen BatchNorm) folded the average in")
        with torch.no_grad():
            model(torch.ones(1, 3))
        check(not opt.in_flight and holds(model, want), f"after evaluating: in flight {opt.in_flight}, weights "
              f"{model.weight.detach().reshape(-1).tolist()}, want the mean {want}")
        model.train()
    dss.synchronize_models(model)
    check(holds(model, want), f"after synchronize_models {model.weight.detach().reshape(-1).tolist()}")


def check_fold_hooks_see_what_a_fold_added():
    """A copy of the model taken with an average in flight, plus what the fold hooks are told the fold added
    once it lands (steps later), is what evaluating the model then gives: the mean of the ranks' copies (one
    group of every rank, averaged every 4 steps: nothing local since it was sent). A removed hook is not
    called; with ``outer_momentum`` (whose outer step the moves would not include) registering is refused."""
    model, opt, _, in_flight = train(4, overlap=True, average_every=4, schedule="shuffle", num_groups=1)
    check(in_flight[-1], f"in flight after the averaging step: {in_flight}")
    copy = model.weight.detach().clone()
    want = hvd.allgather(copy, name="test.copies").mean(dim=0, keepdim=True)
    calls = []

    def hook(moves):
        calls.append([name for name, _ in moves])
        copy.add_(dict(moves)["weight"])

    handle = opt.register_fold_hook(hook)
    c = torch.full((1, 3), float(RANK + 1))
    for step in range(4, 12):
        opt.zero_grad()
        (model.weight * c).sum().backward()
        opt.step()
        if calls:  # folded in: the next average's fold, by step 11 at the latest, must not reach the hook
            handle.remove()
    check(calls == [["weight"]] and torch.allclose(copy, want, atol=1e-6),
          f"hook calls {calls}; the copy corrected {copy.tolist()}, what evaluating gave {want.tolist()}")
    dss.synchronize_models(model)
    try:
        dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                 overlap=True, outer_momentum=0.5).register_fold_hook(hook)
    except ValueError as error:
        check("outer_momentum=0.5" in str(error), f"the refusal {error}")
    else:
        check(False, "register_fold_hook beside outer_momentum was not refused")


def check_route_kept_beside_overlap(steps):
    """Global averages sent through the racks on demand (``global_via_bridges=True``) keep their route beside
    ``overlap=True``, waited for (as the default's trial does), while the racks' averages run behind the
    steps; the mean of what the ranks computed is kept throughout."""
    options = dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=2, global_every=4,
                   schedule_options={"intra_steps": None, "global_via_bridges": True})
    model, opt, kinds, in_flight = train(steps, overlap=True, **options)
    plan = SyncPlan(rank=RANK, world_size=SIZE, **options)
    routed = [t for t in range(steps) if plan.global_route(t) is not None]
    overlapped = [t for t in range(steps) if plan.action(t).kind == "group" and in_flight[t]]
    check(routed and not any(in_flight[t] for t in routed) and overlapped,
          f"global averages through the racks at steps {routed}, in flight after them: "
          f"{[t for t in routed if in_flight[t]]}; rack averages in flight after steps {overlapped}")
    dss.synchronize_models(model)
    want = computed_mean(steps)
    check(holds(model, want), f"after synchronize_models {model.weight.detach().reshape(-1).tolist()}, want {want}")


def check_global_average_in_fragments(steps, fragments=3):
    """``overlap=True`` with HVD_DSSYNC_GLOBAL_FRAGMENTS: a global average goes in fragments, one weight each (a
    weight of 3 in 3), sent at the global step and the two after it, each folded in at the next step. Right
    after fragment k's fold, weight k less this rank's own local step since (``-lr * c``) is the mean of the
    ranks' weight k when it was sent: the same on every rank. Each step moves the model by its local step plus
    what the fold hooks were told (whole tensors, zero outside the fragment), and synchronize_models leaves the
    mean of what the ranks computed."""
    options = dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=4, global_every=8,
                   schedule_options={"intra_steps": None})
    os.environ[FRAGMENTS_ENV] = str(fragments)
    try:
        model, opt, kinds, _ = train(1, overlap=True, **options)
    finally:
        del os.environ[FRAGMENTS_ENV]
    plan = SyncPlan(rank=RANK, world_size=SIZE, **options)
    starts = [t for t in range(steps - fragments) if plan.action(t).kind == "global"]
    c = torch.full((1, 3), float(RANK + 1))
    folded = {}

    def after_step(step):
        # After the fold of the fragment sent at the step before: its weight, less this step's own local step.
        k = next((step - 1 - s for s in starts if 0 <= step - 1 - s < fragments), None)
        if k is not None:
            agreed = hvd.allgather((model.weight.detach()[:, k] + LR * c[:, k]).reshape(1),
                                   name=f"test.fragment.{step}").tolist()
            folded[step] = (k, agreed)

    check_folds_told(model, opt, kinds, steps, after_step)
    unequal = {step: got for step, (k, got) in folded.items() if max(got) - min(got) > 1e-5}
    check(starts and len(folded) == fragments * len(starts) and not unequal,
          f"global averages at steps {starts}; after each fragment's fold, its weight less the local step on each "
          f"rank: {folded}; unequal at {unequal}")
    dss.synchronize_models(model)
    want = computed_mean(steps)
    check(holds(model, want), f"after synchronize_models {model.weight.detach().reshape(-1).tolist()}, want {want}")


def check_one_host_runs_no_trial():
    """On one host (this job) ``overlap=None`` is off from the start: nothing to hide an average behind."""
    _, opt, _, _ = train(OverlapTrial(0, 2).last + 2, average_every=2, schedule="shuffle", num_groups=1)
    check(opt.overlap is False, f"overlap {opt.overlap} on one host")


for name, steps, options in common.STALE_FOLD_CASES:
    with behaviour(name):
        check_stale_fold_is_exact(steps, **options)
with behaviour("an exact bridge after an overlapped rack average sends the rack's average"):
    check_bridge_sends_the_racks_average(10)
with behaviour("evaluating the model folds in the average in flight, on that rank alone"):
    check_evaluation_folds_the_average_in_flight(6)
with behaviour("the fold hooks see what a fold added to the model"):
    check_fold_hooks_see_what_a_fold_added()
with behaviour("overlap=True beside global averages through the racks on demand keeps the route, waited for"):
    check_route_kept_beside_overlap(21)
with behaviour("a global average in flight in fragments, each folded in exactly at the next step"):
    check_global_average_in_fragments(20)
with behaviour("one host runs no trial of overlap"):
    check_one_host_runs_no_trial()
print(f"rank {RANK}: all checks passed", flush=True)
