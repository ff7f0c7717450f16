"""A rank waiting in ``hvd.allreduce`` (``hvd.synchronize``) for a late peer must leave the core to others.

Horovod 0.28.1 as released waits by yielding the core in a loop; with more ranks than cores those loops kept
Horovod's background and Gloo threads off the CPU until Gloo's timeout (docs/reliability.md). The project's
build backs off to short sleeps (scripts/patch_horovod.py, "Waiting without starving the workers").
"""
import time

import horovod.torch as hvd
import torch

LATE_S = 3.0

hvd.init()
hvd.allreduce(torch.ones(1), name="start")  # every rank here before the clock starts
if hvd.rank() == 1:
    time.sleep(LATE_S)
wall, cpu = time.monotonic(), time.thread_time()
hvd.allreduce(torch.ones(1), name="late")
wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
print(f"rank {hvd.rank()}: waited {wall:.2f} s, {cpu:.2f} s of CPU in this thread", flush=True)
if hvd.rank() == 0:
    assert wall > 0.8 * LATE_S, f"rank 0 did not wait for the late rank ({wall:.2f} s)"
    assert cpu < 0.25 * wall, (f"rank 0 used {cpu:.2f} s of CPU while waiting {wall:.2f} s: hvd.synchronize spins "
                               "(Horovod built without scripts/patch_horovod.py's wait patch: run scripts/setup.sh)")
print(f"rank {hvd.rank()}: all checks passed", flush=True)
