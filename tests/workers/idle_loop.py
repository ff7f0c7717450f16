"""Horovod's loop sleeps while idle and wakes for ops (scripts/patches/waking-idle-loop.patch, patch level 11).

With an idle cycle of 1 s a rank's loop runs a few cycles in 2 s with nothing to do, where at Horovod's 1 ms it runs
hundreds; ops issued one after the other (allreduces, a process set added, used and removed) are not held by it:
each would wait up to a second if the loop were not woken. As released the C API is missing: the first check fails.
"""
import time

import horovod.torch as hvd
import torch

from hvd_dssync import horovod_loop

IDLE_MS = 1000.0
OPS = 30

hvd.init()
rank = hvd.rank()
assert horovod_loop.set_idle_cycle(IDLE_MS), \
    "Horovod built without scripts/patches/waking-idle-loop.patch (patch level 11): run scripts/setup.sh"
hvd.allreduce(torch.ones(1), name="start")  # every rank here before the loop is watched

before = horovod_loop.loop_cycles()
time.sleep(2.0)
idle = horovod_loop.loop_cycles() - before
assert idle <= 8, f"rank {rank}: the loop ran {idle} cycles in 2 s idle with a {IDLE_MS:g} ms idle cycle"

started = time.monotonic()
for k in range(OPS):
    total = hvd.allreduce(torch.full((4,), float(rank + k)), name=f"op.{k}", op=hvd.Sum)
    assert torch.equal(total, torch.full((4,), float(sum(range(hvd.size())) + k * hvd.size()))), total
ops = time.monotonic() - started
assert ops < 0.25 * OPS * IDLE_MS / 1000, f"rank {rank}: {OPS} allreduces took {ops:.1f} s: the loop was not woken"

started = time.monotonic()
pair = hvd.add_process_set([0, 1])
if rank in (0, 1):
    assert hvd.allreduce(torch.ones(1), name="pair", op=hvd.Sum, process_set=pair).item() == 2.0
hvd.remove_process_set(pair)
sets = time.monotonic() - started
assert sets < 4 * IDLE_MS / 1000, f"rank {rank}: a set added, used and removed took {sets:.1f} s"

horovod_loop.set_idle_cycle(0)  # Horovod's own pacing again: the loop runs at its 1 ms cycle
time.sleep(0.2)
before = horovod_loop.loop_cycles()
time.sleep(1.0)
busy = horovod_loop.loop_cycles() - before
assert busy >= 30, f"rank {rank}: the loop ran {busy} cycles in 1 s at Horovod's own cycle"
print(f"rank {rank}: {idle} cycles in 2 s idle, {busy} in 1 s at Horovod's cycle; {OPS} allreduces in {ops:.2f} s, "
      f"a set added, used and removed in {sets:.2f} s", flush=True)
print(f"rank {rank}: all checks passed", flush=True)
