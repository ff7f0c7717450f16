"""The racks' period where their averages hide: what the default's trial (:mod:`hvd_dssync.overlap`) reads from the
steps after which the racks' averages it sent in flight were folded in.

A rack's average in flight runs behind the local steps that follow it and is folded in once done. Where they were
folded in within a quarter of the period as built (:data:`HIDES_WITHIN`: 2 steps of the default's 8) on every rank,
they hide behind compute with room to spare: averaging the racks twice as often, in flight, costs the steps little and
halves the drift of the ranks' models between their averages, which is what kept rank 0 behind PyTorch's
hierarchical averager on the bench's ``accelerator`` (docs/gpu.md has the figures). It pays from the first steps
(the models drift most there), so where the default chose the period itself (``average_every`` not given) it starts
at half of it and probes (:class:`HidingProbe`): after a waited period, two with the racks' averages in flight.
Where they hid, it keeps the half period and overlap, and the trial ends; else the period as built comes back and
the trial of both ways runs, which may still halve it where its overlapped half saw them hide
(:func:`quickened_every`). Recorded: 1.2-2.0 steps on the accelerator's 4 ranks, 5.7-8 on the static headline, 3.2-3.8
with 8 ranks on 2 cores (``tests/test_rhythm.py``).

Numpy only.
"""
import math

import numpy as np

from .fragments import GLOBAL_FOLD_STEPS

__all__ = ["staleness", "quickened_every", "hides_maybe", "HidingProbe", "replicates", "averages_cycle",
           "global_places", "HIDES_WITHIN", "MIN_FOLDS", "HIDING_PERIODS", "HIDING_RING_STEPS"]

HIDES_WITHIN = 0.25  # the racks' averages hide where folded in within this share of their period, on average
MIN_FOLDS = 2  # ... on every rank, each having told at least this many folds
HIDING_PERIODS = 3  # the probe's periods (of the period as built): one waited, two with the racks every half in flight
HIDING_RING_STEPS = 2.0  # ... only where a ring of an eighth of the model across the racks took at most this many
# local steps: on the static headline 3-18 (its racks' averages folded in 5.7-8 steps late), the accelerator 0.7-1.1.


def staleness(folds, period):
    """After how many steps the overlapped half folded in its averages in flight but the global ones, from every
    rank's ``(steps summed, averages)`` (:meth:`hvd_dssync.overlap.OverlapTrial.note_fold`): the largest of the ranks'
    means, at least ``GLOBAL_FOLD_STEPS``, at most ``period``; ``period`` where no rank folded one in (unsure: as late
    as the next average, the latest an average in flight may be folded in).

    Example::

        >>> staleness([[3, 3], [4, 3]], 8), staleness([[30, 3]], 8), staleness([[0, 0], [0, 0]], 8)
        (1.3333333333333333, 8.0, 8.0)
    """
    folds = np.asarray(folds, dtype=float).reshape(-1, 2)
    means = [steps / count for steps, count in folds if count > 0]
    return float(min(max(max(means), GLOBAL_FOLD_STEPS), period)) if means else float(period)


def quickened_every(folds, period):
    """The racks' period after the trial: half of ``period`` where every rank's ``(steps summed, averages)`` of the
    racks' averages folded in by the overlapped half (:func:`staleness`) tells at least :data:`MIN_FOLDS` folds, and
    they were folded in within :data:`HIDES_WITHIN` of ``period`` (the largest of the ranks' means) and ``period`` is
    even and 4 or more; else None, the period stays.

    Example::

        >>> quickened_every([[9, 6], [11, 6]], 8), quickened_every([[34, 6], [30, 6]], 8)   # 1.8 steps; 5.7
        (4, None)
        >>> quickened_every([[2, 1], [11, 6]], 8), quickened_every([[9, 6]], 6), quickened_every([[2, 2]], 2)
        (None, 3, None)
    """
    rows = np.asarray(folds, dtype=float).reshape(-1, 2)
    period = int(period)
    if rows.size == 0 or (rows[:, 1] < MIN_FOLDS).any() or period < 4 or period % 2:
        return None
    stale = staleness(rows, period)
    return period // 2 if math.isfinite(stale) and stale <= HIDES_WITHIN * period else None


def hides_maybe(ring, local_step):
    """Whether the racks' averages may hide, so that the probe of their period runs (:class:`HidingProbe`): the
    seconds of one ring over every rank of an eighth of the model (``ring``, the probe of the global averages' way)
    were :data:`HIDING_RING_STEPS` local steps (``local_step``) or fewer; nothing timed (NaN): no.

    Example::

        >>> hides_maybe(0.09, 0.13), hides_maybe(0.06, 0.01), hides_maybe(float("nan"), 0.13)
        (True, False, False)
    """
    return bool(ring <= HIDING_RING_STEPS * local_step)


class HidingProbe:
    """Whether the racks' averages hide, probed as training starts (the default's trial, where it may halve their
    period): after one period as built, waited for (the sets' first ops, the probe of the global averages' way, which
    calls it off where they cannot hide: :func:`hides_maybe`), two with the racks averaging every half period in
    flight; at its last step the ranks gather how late each folded them in (:meth:`decide`). Where they hid, the
    racks keep the half period, their averages in flight, and the trial ends; else the period as built comes back
    and the trial of both ways runs after the probe.

    Example::

        >>> probe = HidingProbe(start=0, period=8)
        >>> probe.every, probe.first, probe.step, [probe.in_flight(s) for s in (7, 8, 23, 24)]
        (4, 8, 23, [False, True, True, False])
        >>> for started in (11, 15, 19):
        ...     probe.note_fold(started + 1, started)
        >>> probe.note_fold(5, 3)   # before it: not counted
        >>> probe.folds.tolist(), probe.decide([probe.folds, [6.0, 3.0]])
        ([3.0, 3.0], 4)
    """

    def __init__(self, start, period):
        self.period = int(period)
        self.every = self.period // 2  # the racks' period tried
        self.first = int(start) + self.period  # the first step whose average goes in flight
        self.end = int(start) + HIDING_PERIODS * self.period  # the step after the probe
        self.folds = np.zeros(2)  # the averages it sent in flight and folded in: steps summed, how many
        self.racks_every = None  # decide: the half period where they hid
        self.done = False  # the trial has read its answer (or passed it by)

    @property
    def step(self):
        """The probe's last step, where the ranks decide."""
        return self.end - 1

    def in_flight(self, step):
        """Whether ``step``'s average goes in flight."""
        return self.first <= step < self.end

    def note_fold(self, step, started):
        """A rack's average started at step ``started`` was folded in at ``step``."""
        if self.first <= started < self.end:
            self.folds += (step - started, 1)

    def decide(self, folds):
        """From every rank's folds (rows of :attr:`folds`): the half period where they hid
        (:func:`quickened_every`), else None."""
        self.racks_every = quickened_every(folds, self.period)
        return self.racks_every


def replicates(periods, cycle):
    """How many times a trial times each place of the schedule's cycle each way: enough for ``periods``
    averaging periods, and for 3 or more degrees of freedom left to the noise once each place's own mean is
    taken out (:meth:`hvd_dssync.overlap.OverlapTrial.decide`).

    Example::

        >>> [replicates(4, cycle) for cycle in (1, 2, 3, 4, 8)]
        [4, 3, 2, 2, 2]
    """
    return max(-(-int(periods) // cycle), 1 + -(-3 // cycle))


def averages_cycle(cycle, average_every, global_every):
    """The averages after which the kinds of a plan's averages repeat: the schedule's ``cycle`` of group
    averages, and a global average in place of every ``global_every / average_every``-th average, which
    leaves the schedule's place where it was. Where ``global_every`` is no multiple of ``average_every`` its
    averages fall between the periods: the schedule's cycle alone.

    Example::

        >>> averages_cycle(4, 8, 0), averages_cycle(1, 8, 32), averages_cycle(4, 8, 32), averages_cycle(4, 4, 10)
        (4, 4, 16, 4)
    """
    if not global_every or global_every % average_every:
        return cycle
    every = global_every // average_every
    return every * cycle // math.gcd(every - 1, cycle)


def global_places(plan, first, period, blocks):
    """The averaging periods, of the ``blocks`` from step ``first`` on (``period`` steps each), that hold one of
    ``plan``'s global averages (its ``action(step).kind``).

    Example::

        >>> from hvd_dssync.plan import SyncPlan
        >>> plan = SyncPlan(rank=0, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]],
        ...                 average_every=4, global_every=16)
        >>> global_places(plan, first=4, period=4, blocks=8)
        (2, 6)
    """
    from .policy import GLOBAL
    return tuple(k for k in range(blocks)
                 if any(plan.action(s).kind == GLOBAL for s in range(first + k * period, first + (k + 1) * period)))
