"""Two groups whose last averages finish seconds apart, and a script that ends without a global op.

The groups are fixed ({0, 1} and {2, 3}) and ranks 2 and 3 pause 3 s before their last step, so ranks 0
and 1 reach the end first, every time: with the exit drain they wait for the others; without it they shut
Horovod down while ranks 2 and 3 still have a step to average.
"""
import time

import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch

STEPS = 20


class FixedPairs:
    """Ranks 0 and 1 always average together, and so do ranks 2 and 3."""
    world_size = 4

    def groups(self, step):
        return [[0, 1], [2, 3]]


hvd.init()
model = torch.nn.Linear(200, 200)
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), schedule=FixedPairs())
for step in range(STEPS):
    opt.zero_grad()
    model(torch.randn(4, 200)).sum().backward()
    if hvd.rank() >= 2 and step == STEPS - 1:
        time.sleep(3.0)
    opt.step()
print(f"rank {hvd.rank()} done", flush=True)
