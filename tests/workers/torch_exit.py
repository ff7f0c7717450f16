"""Ranks whose last groups finish at different times, and a script that ends without a global op."""
import time

import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch

hvd.init()
model = torch.nn.Linear(200, 200)
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), num_groups=2, seed=0)
for _ in range(20):
    opt.zero_grad()
    model(torch.randn(4, 200)).sum().backward()
    if hvd.rank() >= hvd.size() // 2:
        time.sleep(0.05)  # half of the ranks are slower, so groups finish apart
    opt.step()
print(f"rank {hvd.rank()} done", flush=True)
