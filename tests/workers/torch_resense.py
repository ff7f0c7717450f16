"""One rank of a job of one rank per emulated host, 2 racks, whose link between the racks the test slows down
while the job trains: the default optimizer (``HVD_DSSYNC_RESENSE=1``, overlap off), built on a flat network,
senses the racks again when the link slows and takes the topology-aware schedule on them. Rank 0 asks the test for the
change through a file in ``RESENSE_DIR``; the other ranks wait for it in the next average. Every check raises
on failure, so a failing rank fails the job.
"""
import json
import os
import time

import common
import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch
from common import check

PHASE_STEPS = 64  # steps on each network: a change is decided on two or three checks after it (8 steps each)
RATE_WAIT_SECONDS = 30

hvd.init()
RANK, SIZE = common.identify(hvd)
folder = os.environ["RESENSE_DIR"]

torch.manual_seed(RANK)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
# Overlap off: the watch reads only averages waited for (with overlap on it reads nothing), and the trial
# of overlap would decide on the job's noise whether it can (the watch's side of the trial:
# tests/test_sensing.py::test_the_watch_reads_no_overlapped_average).
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                               model=model, overlap=False)


def train(steps):
    """``steps`` steps; the slowest one's seconds."""
    slowest = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        opt.zero_grad()
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        slowest = max(slowest, time.perf_counter() - started)
    return round(slowest, 3)


def network(rate):
    """Rank 0 asks the test for the link's ``rate`` ("slow" or "fast") and waits until it is set."""
    if RANK == 0:
        open(os.path.join(folder, rate), "w").close()
        deadline = time.monotonic() + RATE_WAIT_SECONDS
        while not os.path.exists(os.path.join(folder, f"{rate}.done")):
            check(time.monotonic() < deadline, f"the test did not set the {rate} link")
            time.sleep(0.05)
    hvd.allreduce(torch.zeros(1), name=f"resense.{rate}")


def seen():
    return dict(opt.sensed, schedule=type(opt.schedule).__name__, average_every=opt.policy.average_every,
                groups=[list(g) for g in opt.schedule.groups(opt.sync_step)], overlap=opt.overlap)


check(opt.sensed["how"] == "measured" and opt.sensed["racks"] is None, f"built on {opt.sensed}")
slowest = [train(PHASE_STEPS)]
flat = seen()
check(flat["average_every"] == 8 and flat["groups"] == [list(range(SIZE))], f"flat: {flat}")
network("slow")
slowest.append(train(PHASE_STEPS))
racks = seen()
dss.synchronize_models(model)
if RANK == 0:
    print("SEEN " + json.dumps({"flat": flat, "racks": racks, "slowest": slowest}), flush=True)
