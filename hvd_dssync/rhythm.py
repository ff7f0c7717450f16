"""The racks' period where their averages hide: what the default's trial (:mod:`hvd_dssync.overlap`) reads from the
steps after which its overlapped half folded them in.

A rack's average in flight runs behind the local steps that follow it and is folded in once done. Where the trial's
overlapped half folded the racks' averages in within a quarter of their period (:data:`HIDES_WITHIN`: 2 steps of the
default's 8) on every rank, they hide behind compute with room to spare: averaging the racks twice as often, still in
flight, costs the steps little and halves the drift of the ranks' models between their averages, which is what kept
rank 0 behind PyTorch's hierarchical averager on the bench's ``accelerator`` (docs/gpu.md has the figures). So where
the default chose the period itself (``average_every`` not given), it halves it from its next period
(:meth:`hvd_dssync.policy.Policy.quickened`), the racks' averages in flight, the global averages where they were; the
trial ends at its first look where they hid. Where they were folded in later (the static headline: 5.7-8 steps of 8;
8 ranks on 2 cores: 3.2-3.8), or not twice on every rank, the period stays: unsure is the period as built.

Numpy only.
"""
import math

import numpy as np

from .fragments import GLOBAL_FOLD_STEPS

__all__ = ["staleness", "quickened_every", "HIDES_WITHIN", "MIN_FOLDS"]

HIDES_WITHIN = 0.25  # the racks' averages hide where folded in within this share of their period, on average
MIN_FOLDS = 2  # ... on every rank, each having told at least this many folds


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
