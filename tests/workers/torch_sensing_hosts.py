"""One rank of a job of one rank per emulated host: the default optimizer senses the racks behind the slow
link by timing the host pairs; rank 0 prints what it found, and the period the default takes on the racks."""
import json

import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch

hvd.init()
model = torch.nn.Linear(4, 2)
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
# The probe leaves every rank's op sequence alike: an unnamed op after it would hang otherwise.
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
assert total.item() == hvd.size(), total
if hvd.rank() == 0:
    print("SENSED " + json.dumps(dict(opt.sensed, schedule=type(opt.schedule).__name__,
                                      average_every=opt.policy.average_every)), flush=True)
