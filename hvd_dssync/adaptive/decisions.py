"""The adaptive policy's decisions: every rank's figures in, the next window's :class:`Decision` out.

:func:`decide` is a pure function of the gathered figures and the previous decision, so every rank that
holds the same figures decides alike; it needs no communication.
"""
import math
from typing import NamedTuple

import numpy as np

from ..policy import GLOBAL, GROUP

__all__ = ["FIGURES", "Decision", "initial_decision", "decide"]

# One rank's figures of one window, in this order: the median seconds of a step outside its averaging
# (computing), the fewest seconds of the window's last two global averages (their cost without waits for
# late ranks or a one-off stall: a slow link slows both, and one that slowed inside the window shows at
# its end), the median seconds of a group average (the lower middle one of an even count: of two, one at a
# bridge step, which the ranks that stay in their racks wait for, the other), the largest drift seen (see
# AdaptiveState), and the most seconds of a group average that crossed the racks, of any group average
# where the schedule knows no racks (what stands in for a global average's cost before one was measured:
# see decide; NaN on a rank that crossed none).
FIGURES = ("compute_seconds", "global_seconds", "group_seconds", "drift", "costliest_group_seconds")


class Decision(NamedTuple):
    """What the ranks decided at ``step`` (the last step of a window), and the figures behind it.

    ``mode`` is GLOBAL or GROUP; ``period`` the averaging period of the next window; ``sync_now`` makes
    the next window end with a global average (drift control). The figures are the ranks' medians over the
    window, combined as :func:`decide` says; the last known ones where a window measured none. ``gain`` is
    what group averaging would save of a period's time, ``share`` what the chosen mode's average takes of
    it; ``global_floor`` and ``group_floor`` the least each kind of average has cost so far (the period's
    reference); ``costliest_group_seconds`` each rank's costliest group average of the window that crossed
    the racks (any, where the schedule knows no racks), the median over the ranks that made one.

    Example::

        >>> from hvd_dssync.adaptive import AdaptivePolicy
        >>> d = initial_decision(AdaptivePolicy())
        >>> d.mode, d.period, sorted(d.as_dict())[:3]
        ('group', 8, ['compute_seconds', 'costliest_group_seconds', 'drift'])
    """
    step: int
    mode: str
    period: int
    sync_now: bool
    compute_seconds: float
    global_seconds: float
    group_seconds: float
    drift: float
    gain: float
    share: float
    reason: str
    global_floor: float = float("nan")
    group_floor: float = float("nan")
    costliest_group_seconds: float = float("nan")

    def as_dict(self):
        return self._asdict()

    @property
    def is_start(self):
        """Whether this is :func:`initial_decision`'s, taken before any figure (the first window's)."""
        return self.step < 0


def initial_decision(policy):
    """Before any figure: group averages every ``first_period`` steps (the longest period by default), for
    the first window, at whose end the ranks gather their figures and decide: they start with the cheap
    average, and few of them, whose cost they do not know yet, and pay for a global one only where it costs
    about what a group average does (see :func:`decide`). The next window starts from the shortest period.

    Example::

        >>> from hvd_dssync.adaptive import AdaptivePolicy
        >>> d = initial_decision(AdaptivePolicy(min_period=2, max_period=4, decide_every=8))
        >>> d.mode, d.period
        ('group', 4)
    """
    nan = float("nan")
    return Decision(-1, GROUP, policy.first_period, False, nan, nan, nan, nan, nan, nan, "start")


def _least(a, b):
    """The smaller of two figures, either of which may be NaN (unknown)."""
    return b if not math.isfinite(a) else a if not math.isfinite(b) else min(a, b)


def _typical(column, fallback):
    """The median over the ranks of a figure (the typical rank's), or ``fallback`` where none measured it."""
    finite = column[np.isfinite(column)]
    return float(np.median(finite)) if finite.size else fallback


def _largest(column, previous, smallest=False):
    finite = column[np.isfinite(column)]
    if not finite.size:
        return previous
    return float(finite.min() if smallest else finite.max())


def decide(figures, previous, policy, step):
    """The next window's :class:`Decision`, from every rank's ``figures`` (rows, in :data:`FIGURES`' order).

    A pure function of its arguments: every rank, given the same gathered figures, decides alike. The
    slowest rank paces the steps in either mode, so the compute time and the drift are the largest over
    the ranks: under global averages every rank waits for it at every average, and under group averages
    its partners wait for it, their next partners for them, and so on, since the groups change or are
    bridged so that every model reaches every other (a straggler favours neither mode; groups only make the
    averages cheaper). A group average's cost is the median rank's (a straggler's partners wait for it
    inside their group averages: that wait is the straggler's, already counted). A global average is one
    collective of all ranks, and its time on a rank includes waiting for the others to arrive (after group
    averages the ranks drift apart in time); the last to arrive waits for nobody, so its time, the
    smallest, is the collective's own cost. A figure no rank measured keeps its previous value.

    Before any global average was measured (the first window averages in groups only), a global average
    is taken to cost what the costliest group average that crossed the racks cost: it crosses every link
    that any group crosses, and a schedule that knows the racks crosses them in its bridge steps. The
    figure is the median over the ranks that crossed (a bridge may join only two ranks across the racks:
    the others only wait for it, in Horovod's cycles, which negotiate every process set in turn, and see
    less of its cost than the bridge ranks do); where the schedule knows no racks, every rank's costliest group average counts. On a fast
    network every group average costs about alike, so the gain is small and the ranks average globally
    from then on; behind a slow link the bridges cost several times the averages inside the racks, and the
    ranks keep group averages until a probe measures a global one.
    An estimate chooses group averages only where the costliest group average costs at least
    ``raise_ratio`` times the typical one as well (what the period takes for a real change of cost): on a
    fast network the costliest is the typical one plus noise and waits, well below the ratio that a slow
    link between the racks shows (docs/tuning.md has the bench's figures). Where a global average costs more than that, group
    averages only gain more; where it costs less, the first probe (or a window of global averages) says so.

    Example::

        >>> from hvd_dssync.adaptive import AdaptivePolicy
        >>> p = AdaptivePolicy(decide_every=8, max_period=4)
        >>> start = initial_decision(p)
        >>> fast = [[0.010, 0.002, 0.001, 0.0, 0.001]] * 4  # compute, global, group, drift, costliest group
        >>> decide(fast, start, p, 7).mode
        'global'
        >>> slow = [[0.010, 0.200, 0.001, 0.0, 0.001]] * 4  # a global average now takes 200 ms
        >>> d = decide(slow, start, p, 7); d.mode, d.period
        ('group', 1)
        >>> crossed, stayed = [0.010, float("nan"), 0.001, 0.0, 0.150], [0.010, float("nan"), 0.001, 0.0, float("nan")]
        >>> bridged = [crossed] * 2 + [stayed] * 2
        >>> decide(bridged, start, p, 7).reason  # no global average yet; the two ranks that crossed: 150 ms
        'group averages save 93% of a period (a global average taken to cost the costliest group one, 0.15 s)'
    """
    figures = np.asarray(figures, dtype=np.float64).reshape(-1, len(FIGURES))
    compute = _largest(figures[:, 0], previous.compute_seconds)
    global_cost = _largest(figures[:, 1], previous.global_seconds, smallest=True)
    group_cost = _typical(figures[:, 2], previous.group_seconds)
    drift = _largest(figures[:, 3], float("nan"))
    costliest_group = _typical(figures[:, 4], previous.costliest_group_seconds)
    # The first window's period is its own (first_period): the next starts from the shortest.
    mode, period, reasons = previous.mode, policy.min_period if previous.is_start else previous.period, []
    gain = share = float("nan")
    # Before any global average was measured, the costliest group average stands in for one.
    estimated = not math.isfinite(global_cost) and math.isfinite(costliest_group)
    global_guess = costliest_group if estimated else global_cost
    known = math.isfinite(global_guess) and math.isfinite(group_cost) and math.isfinite(compute)
    if known:
        # Both modes wait for the slowest rank's steps: what group averages save is the averages' cost.
        global_period = period * compute + global_guess
        gain = (global_period - (period * compute + group_cost)) / max(global_period, 1e-12)
        guessed = f" (a global average taken to cost the costliest group one, {global_guess:.3g} s)" if estimated else ""
        # An estimate shows a slow link only where the costliest group average stands apart from the typical
        # one as a real change of cost does for the period (raise_ratio): a fast network's is noise and waits.
        apart = not estimated or global_guess >= policy.raise_ratio * group_cost
        if previous.is_start:  # the first decision: group averages only where they pay as a switch would
            mode = GROUP if gain > policy.enter_gain and apart else GLOBAL
            if gain > policy.enter_gain and not apart:
                reasons.append(f"the costliest group average, {global_guess:.3g} s, costs only "
                               f"{global_guess / group_cost:.1f}x the typical one: no slow link seen")
            else:
                reasons.append(f"group averages save {'only ' if mode == GLOBAL else ''}{gain:.0%} of a period{guessed}")
        elif mode == GLOBAL and gain > policy.enter_gain and apart:
            mode = GROUP
            reasons.append(f"group averages save {gain:.0%} of a period{guessed}")
        elif mode == GROUP and gain < policy.leave_gain:
            mode = GLOBAL
            reasons.append(f"group averages save only {gain:.0%} of a period{guessed}")
    global_floor = _least(previous.global_floor, global_cost)
    group_floor = _least(previous.group_floor, group_cost)
    cost, floor = (global_cost, global_floor) if mode == GLOBAL else (group_cost, group_floor)
    if math.isfinite(cost) and math.isfinite(compute):
        share = cost / max(period * compute + cost, 1e-12)
    if math.isfinite(cost) and math.isfinite(floor) and floor > 0:
        periods = policy.periods()
        at = periods.index(period) if period in periods else 0
        ratio = cost / floor
        if ratio >= policy.raise_ratio * 2 ** at and at + 1 < len(periods):
            period = periods[at + 1]
            reasons.append(f"an average costs {ratio:.1f}x its least")
        elif at > 0 and ratio <= policy.lower_ratio * 2 ** (at - 1):
            period = periods[at - 1]
            reasons.append(f"an average costs only {ratio:.1f}x its least")
    sync_now = mode == GROUP and policy.drift_bound is not None and math.isfinite(drift) and drift > policy.drift_bound
    if sync_now:
        reasons.append(f"drift {drift:.3g} above {policy.drift_bound:g}")
    return Decision(int(step), mode, int(period), bool(sync_now), compute, global_cost, group_cost, drift,
                    gain, share, "; ".join(reasons) or "unchanged", global_floor, group_floor, costliest_group)
