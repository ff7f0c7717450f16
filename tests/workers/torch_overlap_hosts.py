"""One rank of a job of one rank per emulated host: the one-line swap's trial of overlap (hvd_dssync.overlap)
runs after its first averaging period and decides alike on every rank, at its first look or at its last step,
the global averages' way too where the racks' route is "auto", the racks' averages' by the steps after which the
overlapped half folded them in; every rank prints what it decided, rank 0 what it logged, and after
synchronize_models() every rank holds the same model."""
import logging
import re

import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch
from hvd_dssync.overlap import OverlapTrial

logged = []
handler = logging.Handler()
handler.emit = lambda record: logged.append(record.getMessage())
logging.getLogger("hvd_dssync").addHandler(handler)
logging.getLogger("hvd_dssync").setLevel(logging.INFO)
hvd.init()
model = torch.nn.Linear(64, 8)
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
trial = OverlapTrial.of(opt)
last = trial.last
for step in range(last + 3):
    opt.zero_grad()
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()
    assert opt.overlap is (None if step < trial.look else opt.overlap), (step, opt.overlap)
assert opt.overlap in (True, False), opt.overlap
assert opt.overlap_trial.startswith(f"overlap {'on' if opt.overlap else 'off'}"), opt.overlap_trial
# The racks' averages sent in flight in the overlapped half were told to the trial as they were folded in.
assert re.search(r"; the others folded in [\d.]+ steps? late\)$", opt.overlap_trial), opt.overlap_trial
dss.synchronize_models(model)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
models = hvd.allgather(flat.reshape(1, -1), name="test.models")
assert all(torch.equal(models[0], m) for m in models), "the ranks' models differ after synchronize_models()"
for message in logged:
    if "overlap on" in message or "overlap off" in message:
        print(f"LOGGED {message}", flush=True)
print(f"OVERLAP {opt.overlap} after {last + 3} steps, every {opt.policy.average_every}", flush=True)
