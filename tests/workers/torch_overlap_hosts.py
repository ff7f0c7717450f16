"""One rank of a job of one rank per emulated host: the one-line swap's trial of overlap (hvd_dssync.overlap) on
the racks it sensed, their period the default's: it probes first whether the racks' averages hide at half of it
(hvd_dssync.rhythm; the rule's outcome forced here, so that this path is always taken: the rule itself is tested on
recorded figures, the other path in keras_overlap_hosts.py), after the probe of the global averages' way, and
decides alike on every rank at the probe's last step: overlap on, the racks every 4 steps from its second period. Every rank
prints what it decided, rank 0 what it logged. Each rank's gradient is a constant of its own (``rank + 1``), so after
synchronize_models() every rank must hold the mean of what each rank computed, exactly: every average in flight,
every fragment, folded in."""
import logging
import re

import horovod.torch as hvd
import hvd_dssync.rhythm
import hvd_dssync.torch as dss
import torch
from hvd_dssync.rhythm import HIDING_PERIODS

hvd_dssync.rhythm.quickened_every = lambda folds, period: period // 2  # the rule's outcome forced: see above
hvd_dssync.rhythm.HIDING_RING_STEPS = float("inf")  # and the probe run whatever the ring took
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
every = opt.policy.average_every
decided_at = opt.policy.warmup_steps + HIDING_PERIODS * every - 1  # the probe's last step
steps = decided_at + 2 * opt.policy.period() + 1  # two global averages after the probe
for step in range(steps):
    model.weight.grad = torch.full_like(model.weight, float(hvd.rank() + 1))
    opt.step()
    assert opt.overlap is (None if step < decided_at else True), (step, opt.overlap)
assert opt.policy.average_every == every // 2 and opt.policy.since[0] == every, opt.policy  # after its first period
assert re.search(r"^overlap on \(the racks' averages hid in flight; .*; the others folded in [\d.]+ steps? late: "
                 r"the racks every 4 steps from step 8\)$", opt.overlap_trial), opt.overlap_trial
dss.synchronize_models(model)
want = -LR * steps * sum(r + 1 for r in range(hvd.size())) / hvd.size()
assert torch.allclose(model.weight, torch.full_like(model.weight, want), atol=1e-5), (model.weight.unique(), want)
for message in logged:
    if "overlap on" in message or "overlap off" in message:
        print(f"LOGGED {message}", flush=True)
print(f"OVERLAP {opt.overlap} after {steps} steps, every {opt.policy.average_every} from step {opt.policy.since[0]}",
      flush=True)
