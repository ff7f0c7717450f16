"""Sensing again when the network changes: what the default (``topology="auto"``) watches while it trains.

The default senses the racks once, when the optimizer is built (:mod:`hvd_dssync.sensing`). A link that
slows down later (contention) or recovers would leave it on the wrong schedule: averaging over every rank
across a link that has become the bottleneck, or keeping racks apart on a network that is flat again. So,
where the racks were measured, the optimizer watches what the averages that cross the network cost:

- an average *crosses* where its group spans the racks the schedule knows (a topology-aware bridge), or,
  on a network sensed flat, where it joins every rank;
- each rank keeps the fewest seconds of its crossing averages waited for since the last check (an overlapped
  average's seconds are what it delayed the step, a fraction of its cost hidden behind compute: with overlap
  on, in the default's trial or kept, the watch reads nothing, and a check with no figure decides nothing); every
  :data:`CHECK_EVERY` steps the ranks gather these figures (one small allgather, read at the next check, so
  that no rank waits for it) and take the smallest: the rank that arrives last at a collective waits for
  nobody, so its time is the link's, not a straggler's or a late rank's (:func:`hvd_dssync.adaptive.decide`
  reads global averages the same way);
- where that figure moved by :data:`CHANGE_RATIO` or more from any earlier check's since the racks were
  last sensed (slower than the cheapest, or cheaper than the costliest), every rank senses again, at the
  same step, timing only the host pairs across the racks in force (the watch sees nothing else move), and
  the optimizer follows what it finds: the topology-aware schedule on racks, one group of every rank on a
  flat network (:meth:`hvd_dssync.config.SyncConfig.resolve`, as when it was built). New groups' process
  sets are registered on a thread while the old groups train on; every rank follows at the first step where
  every rank has them.

Every rank decides from the same gathered figures, so every rank senses again or none does. Numpy only:
the adapters gather the figures and sense.

The watch is off unless ``HVD_DSSYNC_RESENSE=1`` (PyTorch): on the bench's emulated cluster it did not
reach the target sooner, on 12-second jobs (the change at 0.8 s) nor on 60-second ones (at 10 s): the
schedule on racks ran 1.3x the steps after the change but needed more of them (docs/benchmarks.md).
"""
import math
import os

import numpy as np

from .policy import BSP, LOCAL

__all__ = ["NetworkWatch", "watches", "CHECK_EVERY", "CHANGE_RATIO", "RESENSE_ENV"]

CHECK_EVERY = 8  # steps between two checks: an average of every rank on a flat network, a bridge on racks every other
CHANGE_RATIO = 4.0  # how far a crossing average's cost must move to sense again (a slowed link moves it 10x)
RESENSE_ENV = "HVD_DSSYNC_RESENSE"


def watches(sensed, adaptive, environ=None):
    """Whether an optimizer watches the network: ``HVD_DSSYNC_RESENSE`` is "1", its racks were measured when
    it was built (``sensed`` is a :class:`hvd_dssync.sensing.Sensed` of how "measured") and it runs the fixed
    policy (``adaptive`` is None: the adaptive policy follows the cost itself). Host names alone ("hosts")
    and one host say nothing a later look could change.

    Example::

        >>> from hvd_dssync.sensing import Sensed
        >>> on = {"HVD_DSSYNC_RESENSE": "1"}
        >>> watches(Sensed("measured", None, hosts=8), None, on), watches(Sensed("hosts", [[0], [1]]), None, on)
        (True, False)
        >>> watches(Sensed("measured", None, hosts=8), None, {})  # off unless asked for
        False
    """
    environ = os.environ if environ is None else environ
    return (environ.get(RESENSE_ENV, "0") == "1" and sensed is not None and sensed.how == "measured"
            and adaptive is None)


class NetworkWatch:
    """One optimizer's watch of the averages that cross the network (see the module).

    Args:
        warmup_steps: bulk-synchronous steps first; checks count from the end of the warm-up.
        check_every: steps between two checks.
        ratio: how far the crossing averages' cost must move, either way, to sense again.

    Example::

        >>> watch = NetworkWatch(check_every=2)
        >>> watch.note(4, 0.010, crosses=True); watch.note(4, 0.030, crosses=True)
        >>> watch.due(0), watch.due(1), watch.figure()
        (False, True, 0.01)
        >>> watch.decide([0.012, 0.010, float("nan")])  # the first check: the cost to compare with
        False
        >>> watch.decide([0.050, 0.041, 0.045])          # 4.1x the cheapest: the network changed
        True
        >>> watch.restart(); watch.decide([0.041])       # sensed again: a new reference
        False
    """

    def __init__(self, warmup_steps=0, check_every=CHECK_EVERY, ratio=CHANGE_RATIO):
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"Arg ``check_every`` must be a positive integer, got {check_every!r}.")
        if not ratio > 1.0:
            raise ValueError(f"Arg ``ratio`` must be above 1, got {ratio!r}.")
        self.warmup_steps = warmup_steps
        self.check_every = check_every
        self.ratio = float(ratio)
        self._fewest = math.inf
        self._cheapest = math.inf
        self._costliest = -math.inf
        self.checks = 0  # since the racks were last sensed
        self.last = float("nan")  # the last check's figure

    def note(self, world_size, seconds, crosses, group_size=None, kind=None, overlapped=False):
        """After an average of ``seconds`` on this rank: keep it if it crossed the network and was waited for
        (not ``overlapped``). ``crosses`` is the schedule's answer for the group (True, False, or None where the
        schedule knows no racks: then an average crosses where its group, of ``group_size`` ranks, is every one
        of ``world_size``)."""
        if kind in (BSP, LOCAL) or overlapped or not seconds > 0:
            return
        if crosses is None:
            crosses = group_size is None or group_size == world_size
        if crosses:
            self._fewest = min(self._fewest, float(seconds))

    def due(self, step):
        """Whether the ranks check at the end of ``step`` (the same steps on every rank)."""
        return step >= self.warmup_steps and (step - self.warmup_steps + 1) % self.check_every == 0

    def figure(self):
        """This rank's figure for the check, the fewest seconds of its crossing averages since the last (NaN:
        none); forgets them."""
        fewest, self._fewest = self._fewest, math.inf
        return fewest if math.isfinite(fewest) else float("nan")

    def decide(self, figures):
        """Whether to sense again, from every rank's :meth:`figure` (the same list on every rank): the smallest
        figure against the cheapest and the costliest of the earlier checks since the racks were sensed. A
        check where no rank crossed decides nothing."""
        figures = np.asarray(figures, dtype=float)
        finite = figures[np.isfinite(figures)]
        if not finite.size:
            return False
        cost = float(finite.min())
        self.last = cost
        changed = self.checks > 0 and (cost >= self.ratio * self._cheapest or cost * self.ratio <= self._costliest)
        self.checks += 1
        self._cheapest = min(self._cheapest, cost)
        self._costliest = max(self._costliest, cost)
        return changed

    def restart(self):
        """The racks were sensed again: the next check's figure is the new reference."""
        self._fewest = self._cheapest = math.inf
        self._costliest = -math.inf
        self.checks = 0
