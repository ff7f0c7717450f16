"""One rank of a job of one rank per emulated host: the one-line swap's trial of overlap (hvd_dssync.overlap)
runs after its first averaging period and decides alike on every rank, at its first look or at its last step,
the global averages' way too where the racks' route is "auto", the racks' averages' by the steps after which the
overlapped half folded them in; the racks' period halves from the next period (hvd_dssync.rhythm: its rule forced
here, so that the switch is always crossed; the rule itself is tested on recorded figures); every rank prints what
it decided, rank 0 what it logged. Each rank's gradient is a constant of its own (``rank + 1``), so after
synchronize_models() every rank must hold the mean of what each rank computed, exactly: every average in flight,
every fragment, folded in across the switch."""
import logging
import re

import horovod.torch as hvd
import hvd_dssync.overlap
import hvd_dssync.torch as dss
import torch
from hvd_dssync.overlap import OverlapTrial

hvd_dssync.overlap.quickened_every = lambda folds, period: period // 2  # the rule's outcome forced: see above
LR = 0.125  # a power of two: float32 sums stay exact

logged = []
handler = logging.Handler()
handler.emit = lambda record: logged.append(record.getMessage())
logging.getLogger("hvd_dssync").addHandler(handler)
logging.getLogger("hvd_dssync").setLevel(logging.INFO)
hvd.init()
model = torch.nn.Linear(64, 8, bias=False)
torch.nn.init.zeros_(model.weight)
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters())
trial = OverlapTrial.of(opt)
last, every = trial.last, opt.policy.average_every
steps = last + opt.policy.period() + 2 * every + 1  # past the switch, two of the new periods on
for step in range(steps):
    model.weight.grad = torch.full_like(model.weight, float(hvd.rank() + 1))
    opt.step()
    assert opt.overlap is (None if step < trial.look else opt.overlap), (step, opt.overlap)
# Every rank halved the racks' period at the same step, from the period after the trial's decision (its look or last).
since = opt.policy.since[0]
assert opt.policy.average_every == every // 2 and trial.look + 1 < since <= last + 1 + every, (since, last)
assert opt.overlap in (True, False), opt.overlap
assert opt.overlap_trial.startswith(f"overlap {'on' if opt.overlap else 'off'}"), opt.overlap_trial
# The racks' averages sent in flight in the overlapped half were told to the trial as they were folded in.
assert re.search(r"; the others folded in [\d.]+ steps? late: the racks every 4 steps from the next period\)$",
                 opt.overlap_trial), opt.overlap_trial
dss.synchronize_models(model)
want = -LR * steps * sum(r + 1 for r in range(hvd.size())) / hvd.size()
assert torch.allclose(model.weight, torch.full_like(model.weight, want), atol=1e-5), (model.weight.unique(), want)
for message in logged:
    if "overlap on" in message or "overlap off" in message:
        print(f"LOGGED {message}", flush=True)
print(f"OVERLAP {opt.overlap} after {steps} steps, every {opt.policy.average_every} from step {since}", flush=True)
