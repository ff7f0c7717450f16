"""One rank of a 4-rank PyTorch job: DS-Sync inside Horovod process sets, and lossy (fp16) compression.

Scenarios, in one job: process set A = {1, 2, 3} trains with groups of 2 while rank 0 trains alone in
B = {0}; sets {0, 2} and {1, 3} train side by side with a warm-up and global averages; bad process sets
are refused the same way on every rank; fp16 compression keeps updates far below fp16's resolution and
stays within its error bound of the exact group means. ``--init static`` registers the sets with
``dss.init(process_sets=...)``, ``--init dynamic`` with ``hvd.add_process_set`` and
``dss.add_process_set_groups``. Every check raises on failure.
"""
import argparse
from dataclasses import replace

import common
import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(): plain hvd.init() must allow process sets
import torch
from common import check, expect_error, simulate
from hvd_dssync import SyncConfig
from torch_semantics import rank_valued  # (this folder)

SCHEDULE = dict(group_size=2, seed=7)
SYNC = None  # --init static: DS-Sync's arguments as one SyncConfig, passed as sync= to init and the optimizers


def arguments(**kwargs):
    """DS-Sync's arguments: keywords, or ``sync=`` one SyncConfig (--init static; keywords where the
    topology's refusal is checked)."""
    return dict(SCHEDULE, **kwargs) if SYNC is None or "topology" in kwargs else {"sync": replace(SYNC, **kwargs)}
RANK = None


def set_grads(model, value):
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def train_inside(process_set, steps, lr, **kwargs):
    """Every rank of ``process_set``: start at its rank, gradient its rank; compare with the simulation."""
    ranks = sorted(process_set.ranks)
    model = rank_valued(torch.nn.Linear(3, 1), RANK)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), process_set=process_set,
                                   **arguments(**kwargs))
    history = simulate(ranks, opt.schedule, opt.policy, {r: float(r) for r in ranks},
                       {r: float(r) for r in ranks}, lr, steps)
    for t in range(steps):
        set_grads(model, float(RANK))
        opt.step()
        for p in model.parameters():
            check(torch.allclose(p, torch.full_like(p, history[t][RANK]), atol=1e-5),
                  f"set {ranks} step {t}: {p.tolist()}, want {history[t][RANK]}")
        if len(ranks) > 1:
            check(set(opt.last_sync["group"]) <= set(ranks) and RANK in opt.last_sync["group"],
                  f"set {ranks}: group {opt.last_sync['group']} is not of global ranks in the set")
    return model, opt


def check_process_sets(sets):
    a, b, c, d = sets
    # A = {1, 2, 3} in groups of 2 (positions mapped to global ranks); B = {0} alone, untouched.
    mine = a if a.included() else b
    model, opt = train_inside(mine, steps=6, lr=0.0)
    state = opt.state_dict()
    check(state["dssync"]["config"]["schedule"]["world_size"] == len(mine.ranks), "checkpoint's world")
    resumed = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), process_set=mine, **arguments())
    resumed.load_state_dict(state)
    check(resumed.sync_step == 6, f"resumed at step {resumed.sync_step}")
    before = [p.detach().clone() for p in model.parameters()]
    mean = sum(mine.ranks) / len(mine.ranks)
    distance = dss.consensus_distance(model, process_set=mine)
    dss.synchronize_models(model, process_set=mine)
    for p, was in zip(model.parameters(), before):
        check(torch.allclose(p, torch.full_like(p, mean), atol=1e-5), f"synchronized {p.tolist()}, want {mean}")
    check(abs(distance - float(torch.cat([w.reshape(-1) for w in before]).sub(mean).abs().max())) < 1.0,
          f"consensus distance {distance}")
    check(dss.consensus_distance(model, process_set=mine) < 1e-6, "not in consensus after synchronize_models")

    # {0, 2} and {1, 3}, side by side: warm-up allreduce and global averages inside each set.
    train_inside(c if c.included() else d, steps=5, lr=0.1, warmup_steps=1, global_every=2)

    # Bad process sets: the same clear error on every rank concerned, before any communication.
    outside = b if a.included() else a  # ranks outside a set train alone: tests/workers/torch_outside_set.py
    expect_error(ValueError, ["process_set", "not registered"],
                 lambda: train_inside(hvd.ProcessSet([0, 1]), 1, 0.0))
    expect_error(ValueError, ["process_set", "window_steps"],
                 lambda: train_inside(mine, 1, 0.0, schedule_options={"window_steps": 4}))
    expect_error(ValueError, ["process_set", "topology"], lambda: train_inside(mine, 1, 0.0, topology=[[0], [1]]))
    expect_error(ValueError, ["root_rank"], lambda: dss.synchronize_models(model, root_rank=outside.ranks[0],
                                                                           process_set=mine))


def check_missing_groups():
    e = hvd.add_process_set([0, 1, 3])  # every rank, but without its groups
    if e.included():
        expect_error(RuntimeError, ["(0, ", "add_process_set_groups", "every rank"],
                     lambda: train_inside(e, 1, 0.0))


def check_fp16_keeps_small_updates(process_set=hvd.global_process_set):
    """Updates of 5e-5 .. 2e-4 near 1.0, below half of fp16's spacing there (2.4e-4): rounding the weights
    to fp16 would keep them at 1.0 forever. Each step, every rank is checked against the exact mean of its
    group's models, within a bound from fp16's error on the differences."""
    size, lr, steps = hvd.size(), 5e-5, 12
    model = torch.nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), compression=hvd.Compression.fp16,
                                   **arguments(global_every=3))
    grads = torch.arange(1.0, size + 1)
    reference = None
    for t in range(steps):
        now = hvd.allgather(model.weight.detach()[:, :1].reshape(1), name="test.fp16.now")
        before = now.clone().add_(grads, alpha=-lr)  # every rank's model before the average, as SGD computes it
        set_grads(model, float(grads[RANK]))
        opt.step()
        action = opt.last_sync
        group = list(action["group"])
        want = before[group].double().mean().item()
        got = model.weight.detach().double()
        if reference is None:  # the first averaging step is an exact average over all ranks
            check(torch.allclose(got, torch.full_like(got, want), atol=1e-7, rtol=0),
                  f"step {t}: reference average {got.flatten()[:2].tolist()}, want {want}")
        else:
            spread = (before[group].double() - reference).abs().max().item()
            bound = 8 * 2.0 ** -11 * spread + 1e-6
            check((got - want).abs().max().item() <= bound,
                  f"step {t}: {got.flatten()[:2].tolist()} differs from the group mean {want} by more than {bound}")
        if reference is None or action["kind"] == "global":
            reference = hvd.allreduce(model.weight.detach().double().mean(), name="test.fp16.reference").item()
    mean = hvd.allreduce(model.weight.detach().double().mean(), name="test.fp16.mean").item()
    want = 1.0 - lr * steps * grads.double().mean().item()
    check(abs(mean - want) < 1e-5, f"fp16: the ranks' mean is {mean}, want {want} (rounded weights stay at 1.0)")


def main():
    global RANK, SYNC
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", choices=("static", "dynamic"), default="dynamic")
    args = parser.parse_args()
    sets = [hvd.ProcessSet(r) for r in ([1, 2, 3], [0], [0, 2], [1, 3])]
    if args.init == "static":
        SYNC = SyncConfig(**SCHEDULE)
        dss.init(process_sets=sets, sync=SYNC)
    else:
        hvd.init()
        sets = [hvd.add_process_set(s) for s in sets]
        for s in sets:
            dss.add_process_set_groups(s, **SCHEDULE)
    RANK, _ = common.identify(hvd)
    check(hvd.size() == 4, "run this job on 4 ranks")
    check_process_sets(sets)
    if args.init == "dynamic":
        check_missing_groups()
    check_fp16_keeps_small_updates()
    hvd.allreduce(torch.zeros(1), name="test.end")
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
