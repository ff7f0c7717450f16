"""One rank of a PyTorch job across emulated hosts of several ranks each, launched by horovodrun or mpirun.

Checks Horovod's host layout, that DS-Sync with its defaults finds the racks (each host, or with a second
argument that many racks of hosts, measured) and, its averages waited for, averages each step in exactly the
groups its schedule names, that training runs (the defaults: its trial of overlap too), and that
synchronize_models ends in consensus. Every check raises on failure, so a failing rank fails the launch.
"""
import sys

import common
import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(): plain hvd.init() must allow process sets
import torch
from common import averaged, check, check_alike, crosses_hosts, step_groups
from hvd_dssync.config import RACK_GLOBAL_EVERY
from torch_semantics import rank_valued  # (this folder)

hvd.init()
RANK, SIZE = common.identify(hvd)
SLOTS = int(sys.argv[1])
RACKS = int(sys.argv[2]) if len(sys.argv) > 2 else None  # racks of hosts behind a slow link, to be measured

layout, hosts = common.check_host_layout(hvd, hvd.allgather_object, SLOTS)

# Group means with the defaults, every average waited for (the default's trial sends the global averages in flight from
# the end of its set-up period on, folded in over the steps after: tests/workers/torch_overlap_hosts.py): every rank
# starts at its rank; lr 0 leaves only the averaging.
model = rank_valued(torch.nn.Linear(3, 2), RANK)
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                               overlap=False)
sensed = common.check_sensed_hosts(opt.sensed, SIZE, SLOTS, RACKS)
# The default averages inside the racks on racks, and across them in its global average.
plan, values, steps, crossing = opt._plan, [float(r) for r in range(SIZE)], RACK_GLOBAL_EVERY + 4, []
for t in range(steps):
    model.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    kind, groups = step_groups(plan, t, SIZE)
    values = averaged(values, groups)
    if crosses_hosts(groups, SLOTS):
        crossing.append(t)
    for name, p in model.named_parameters():
        got = p.detach().reshape(-1)
        check(torch.allclose(got, torch.full_like(got, values[RANK]), atol=1e-6),
              f"step {t} ({kind}, groups {groups}): {name} holds {got.tolist()}, want {values[RANK]}")
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name=f"test.unnamed.{t}")
    check(total.item() == SIZE, f"allreduce gave {total.item()}")
check(opt.sync_step == steps, f"sync_step {opt.sync_step}")
everyone = hvd.allgather_object([plan.schedule.groups(t) for t in range(steps)], name="test.groups")
check_alike(everyone, f"ranks disagree on the groups: {everyone}")
check(crossing, f"no step averaged across hosts in {steps} steps: {everyone[0]}")

# Training: a regression on each rank's own data, then consensus.
torch.manual_seed(RANK)
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters())
torch.manual_seed(1000 + RANK)
losses = []
for t in range(20):
    x = torch.randn(16, 5)
    opt.zero_grad()
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
check(all(torch.isfinite(torch.tensor(losses))), f"losses {losses}")
check(dss.consensus_distance(model) > 0, "models trained on different data should differ")
dss.synchronize_models(model)
flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])
rows = hvd.allgather(flat.unsqueeze(0), name="test.sync.weights")
common.check_consensus(rows, torch.equal, dss.consensus_distance(model), "synchronize_models")
print(f"rank {RANK} on {hosts[RANK]}: layout {layout}, steps across hosts {crossing}, sensed {sensed.get('how')} {sensed.get('racks')}, "
      f"schedule {type(opt.schedule).__name__}, loss {losses[0]:.3f} -> {losses[-1]:.3f}: all checks passed",
      flush=True)
