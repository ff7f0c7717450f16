"""What a contender's rank 0 marks on its output while it trains, and the scenario's rate changes.

Rank 0 prints ``MARK start`` when training starts and ``MARK end`` when it stops. Each mark is recorded with
the time and the bytes over the bottleneck then; from the start mark on, the scenario's rate changes of the
inter-rack link run on timers (each recorded as ``rate_change.K``), and the end mark cancels those not yet due.
Both ways of starting a contender (the bench's own ranks, the real launchers) read marks through this.
"""
import threading
import time

__all__ = ["MarkWatch", "link_bytes"]


class MarkWatch:
    """The marks of one contender's run on ``bed``, and its ``rate_changes`` (``(seconds, mbit)`` pairs).

    Example::

        watch = MarkWatch(bed, [(4.0, 40.0)], log)
        watch.note("start")           # on rank 0's "MARK start": timers for the rate changes start
        ...
        watch.stop()                  # in a finally: no rate change after the run
        links = link_bytes(watch.marks)
    """

    def __init__(self, bed, rate_changes, log):
        self.bed = bed
        self.rate_changes = list(rate_changes)
        self.log = log
        self.marks = {}
        self._timers = []

    def note(self, what):
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
