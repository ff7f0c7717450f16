"""One rank of a job on one host (loopback): the default optimizer senses "one host", probes nothing and
keeps the default schedule it had before sensing (random groups), and a second optimizer senses nothing
more. Every check raises on failure, so a failing rank fails the launch.
"""
import common
import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch
from common import check
from hvd_dssync import sensing
from hvd_dssync.plan import SyncPlan

hvd.init()
RANK, SIZE = common.identify(hvd)

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
sensed = opt.sensed
check(sensed is not None and sensed["how"] == "one host", f"sensed {sensed}")
check(sensed["found"] == "one rack" and sensed["racks"] is None and sensed["pairs"] == 0, f"sensed {sensed}")
check(sensed["seconds"] < 0.01, f"sensing on one host took {sensed['seconds']} s")
# The schedule of before: random groups of the default size, as SyncPlan builds it without a topology.
expected = SyncPlan(RANK, SIZE, seed=0).schedule
check(opt.schedule.config() == expected.config(), f"schedule {opt.schedule.config()} != {expected.config()}")
for step in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    check(opt.last_sync["kind"] == "group" and len(opt.last_sync["group"]) == SIZE // 2, f"{opt.last_sync}")
# A second optimizer of the job: sensed once per process, the same result, nothing sent.
first = sensing.last_sensed()
other = torch.nn.Linear(4, 2)
opt2 = dss.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), named_parameters=other.named_parameters())
check(sensing.last_sensed() is first and opt2.sensed == sensed, f"{opt2.sensed} != {sensed}")
# Named arguments sense nothing: the schedule is theirs.
opt3 = dss.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), named_parameters=other.named_parameters(),
                                num_groups=1)
check(opt3.sensed is None, f"{opt3.sensed}")
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="sensing.done")
check(total.item() == SIZE, f"{total}")
print("all checks passed", flush=True)
