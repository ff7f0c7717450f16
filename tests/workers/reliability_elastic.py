"""One worker of the elastic job (horovodrun --host-discovery-script): DS-Sync under hvd.elastic.run.

At step CHANGE_AT rank 0 rewrites the host file to NEW_HOSTS (once); the discovery script reads it and
Horovod removes or adds a worker. Every worker must train on with process sets rebuilt for the new world
and the schedule continued from its step (a newcomer's is rank 0's). Usage:
reliability_elastic.py HOSTFILE STEPS CHANGE_AT NEW_HOSTS.
"""
import sys
import time

import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(): plain hvd.init() must allow process sets
import torch

HOSTFILE, STEPS, CHANGE_AT, NEW_HOSTS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters(), model=model, group_size=2, seed=5,
                               schedule_options={"window_steps": 4})
sizes_seen = []


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        if hvd.size() not in sizes_seen:
            sizes_seen.append(hvd.size())
        if state.step == CHANGE_AT and hvd.rank() == 0:
            with open(HOSTFILE) as f:
                changed = f.read().strip() == NEW_HOSTS
            if not changed:
                with open(HOSTFILE, "w") as f:
                    f.write(NEW_HOSTS + "\n")
        generator = torch.Generator().manual_seed(100 * hvd.rank() + state.step)
        x = torch.randn(8, 4, generator=generator)
        state.optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        state.optimizer.step()
        if state.optimizer.sync_step != state.step + 1:
            raise AssertionError(f"rank {hvd.rank()}: DS-Sync step {state.optimizer.sync_step} after training "
                                 f"step {state.step}")
        state.step += 1
        time.sleep(0.3)  # leave the discovery script (polled each second) time to see the change
        state.commit()


state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
train(state)
plan_size = opt.schedule.world_size
steps = hvd.allgather_object(opt.sync_step, name="test.elastic.steps")
groups = hvd.allgather_object([opt.schedule.groups(t) for t in range(8)], name="test.elastic.groups")
if plan_size != hvd.size() or len(set(steps)) != 1 or any(g != groups[0] for g in groups):
    raise AssertionError(f"rank {hvd.rank()}: after the world changed, schedule for {plan_size} ranks in a "
                         f"world of {hvd.size()}, steps {steps}, groups agree: {all(g == groups[0] for g in groups)}")
hvd.barrier()
print(f"rank {hvd.rank()}: sizes {sizes_seen}, finished at step {opt.sync_step} in a world of {hvd.size()}",
      flush=True)
