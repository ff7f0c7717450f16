"""What a contender's rank 0 marks on its output while it trains, and the scenario's rate changes.

Rank 0 prints ``MARK start`` when training starts and ``MARK end`` when it stops. Each mark is recorded with
the time and the bytes over the bottleneck then, and the bench's host's CPU times (how busy its cores were
in between: :func:`cores_busy`); from the start mark on, the scenario's rate changes of the
inter-rack link run on timers (each recorded as ``rate_change.K``), and the end mark cancels those not yet due.
Both ways of starting a contender (the bench's own ranks, the real launchers) read marks through this.
"""
import threading
import time

__all__ = ["MarkWatch", "cores_busy", "cpu_times", "link_bytes"]


class MarkWatch:
    """The marks of one contender's run on ``bed``, and its ``rate_changes`` (``(seconds, mbit)`` pairs).

    Example::

        watch = MarkWatch(bed, [(4.0, 40.0)], log)
        watch.note("start")           # on rank 0's "MARK start": timers for the rate changes start
        ...
        watch.stop()                  # in a finally: no rate change after the run
        links, busy = link_bytes(watch.marks), cores_busy(watch.cpu)
    """

    def __init__(self, bed, rate_changes, log):
        self.bed = bed
        self.rate_changes = list(rate_changes)
        self.log = log
        self.marks = {}
        self.cpu = {}  # the host's CPU times at each mark (cpu_times)
        self._timers = []

    def note(self, what):
        self.cpu[what] = cpu_times()
        self.marks[what] = (time.monotonic(), self.bed.bottleneck_bytes())
        if what == "start":
            for k, (seconds, mbit) in enumerate(self.rate_changes):
                timer = threading.Timer(seconds, self._change_rate, (k, mbit))
                timer.daemon = True
                timer.start()
                self._timers.append(timer)
        elif what == "end":
            self.stop()

    def stop(self):
        for timer in self._timers:
            timer.cancel()

    def _change_rate(self, k, mbit):
        self.marks[f"rate_change.{k}"] = (time.monotonic(), self.bed.bottleneck_bytes())
        self.bed.set_inter_rate(mbit)
        self.log(f"    dynamic contention: inter-rack rate now {mbit} Mbit/s")


def link_bytes(marks):
    """Bytes per bottleneck link during training, split at each rate change that happened."""
    if "start" not in marks or "end" not in marks:
        return None
    (t0, start), (t1, end) = marks["start"], marks["end"]
    changes = sorted((v for k, v in marks.items() if k.startswith("rate_change.")), key=lambda m: m[0])
    phases = [(t0, start)] + [m for m in changes if t0 <= m[0] <= t1] + [(t1, end)]
    out = {"seconds": t1 - t0, "total": {k: end[k] - start[k] for k in end}, "phases": []}
    for (ta, a), (tb, b) in zip(phases, phases[1:]):
        out["phases"].append({"seconds": tb - ta, "bytes": {k: b[k] - a[k] for k in b}})
    return out


def cpu_times(path="/proc/stat"):
    """This host's CPU time over all its cores as ``(busy, total)`` in clock ticks (the first line of
    ``/proc/stat``: idle and waiting on I/O are not busy; guest time is counted in user's), or ``None`` where
    it cannot be read (not Linux)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def cores_busy(cpu, start="start", end="end"):
    """The share of this host's CPU time that was busy between two marks (0 to 1; every core counted), or
    ``None`` where either was not read. Every process on the host counts: where the ranks run here alone,
    how much of the cores training left free to hide an average on. In a container, ``/proc/stat`` is the
    machine's: its other tenants count, and a CPU quota smaller than its cores is not seen.

    Example::

        >>> cores_busy({"start": (1000, 4000), "end": (1600, 4800)})
        0.75
        >>> cores_busy({"start": (1000, 4000)}) is None
        True
    """
    first, last = cpu.get(start), cpu.get(end)
    if first is None or last is None or last[1] <= first[1]:
        return None
    return (last[0] - first[0]) / (last[1] - first[1])
