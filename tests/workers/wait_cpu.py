"""A rank waiting in ``hvd.allreduce`` (``hvd.synchronize``) for a late peer must leave the core to others,
and be woken when the op is done rather than polling for it.

Horovod 0.28.1 as released waits by yielding the core in a loop; with more ranks than cores those loops kept
Horovod's background and Gloo threads off the CPU until Gloo's timeout (docs/reliability.md). The project's
build blocks until the op's callback wakes the waiting thread (scripts/patches/waiting-handles.patch, patch
level 10; level 9 slept between polls, up to 1 ms each, and woke the thread about a thousand times a second).
"""
import time

import horovod.torch as hvd
import torch

LATE_S = 3.0


def switches():
    """How often this thread has left the core (given it up or been taken off it)."""
    with open("/proc/thread-self/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)


hvd.init()
hvd.allreduce(torch.ones(1), name="start")  # every rank here before the clock starts
if hvd.rank() == 1:
    time.sleep(LATE_S)
woken, wall, cpu = switches(), time.monotonic(), time.thread_time()
hvd.allreduce(torch.ones(1), name="late")
wall, cpu, woken = time.monotonic() - wall, time.thread_time() - cpu, switches() - woken
print(f"rank {hvd.rank()}: waited {wall:.2f} s, {cpu:.2f} s of CPU in this thread, left the core {woken} times",
      flush=True)
if hvd.rank() == 0:
    assert wall > 0.8 * LATE_S, f"rank 0 did not wait for the late rank ({wall:.2f} s)"
    assert cpu < 0.25 * wall, (f"rank 0 used {cpu:.2f} s of CPU while waiting {wall:.2f} s: hvd.synchronize spins "
                               "(Horovod built without scripts/patch_horovod.py's wait patch: run scripts/setup.sh)")
    assert woken < 50, (f"rank 0's waiting thread left the core {woken} times in {wall:.2f} s: hvd.synchronize "
                        "polls (Horovod built without scripts/patches/waiting-handles.patch: run scripts/setup.sh)")
print(f"rank {hvd.rank()}: all checks passed", flush=True)
