"""An adaptive policy: the ranks measure what their averages cost, and change mode and period together.

While the network is fast, every averaging step averages over all ranks (the models stay identical);
when a global average costs much more than a group average (a contended link, a slow host), the steps
average inside the schedule's groups instead; the averaging period (``average_every``) grows when an
average costs well above the least it has cost and shrinks back when it no longer does. When the models
drift apart beyond a bound, the next window ends with a global average.

Every rank must take each decision at the same step, so decisions are taken only at the last step of a
*window* of ``decide_every`` steps that ends with a global average, from every rank's figures, by
:func:`decide`, a pure function of those figures and the previous decision. Under global averaging every
window ends so, and the figures ride along in that global average (:func:`encode_figures`: each rank
fills its own slots, the others are zeros, so every rank reads the same numbers): the policy adds no
collective of its own. Under group averaging one window in ``probe_every`` does (a *probe* window, whose
last average is global): the probe's own time is the fresh global figure, so the ranks gather their
figures after it, in one small collective (:meth:`AdaptiveState.end_step` keeps the two apart; the
last rank to arrive at the probe waits for nobody, so the least time over the ranks is the collective's
cost). The ranks start with group averages, every ``first_period`` steps (the longest period by default:
few averages, whose cost they do not know yet; the schedule starts where the last of them is a bridge:
:func:`hvd_dssync.plan.first_crossing`), and gather their figures at the end of the first window, with
no global average in it: before any global average was measured, it is taken to cost what the costliest
group average that crossed the racks cost on the ranks that crossed (a global average crosses every link
that any group crosses, the slow one between racks included, which the topology-aware schedule's bridge
steps cross), and on a fast network, where every group average costs alike, that says: global averages
from then on. Under global averaging the last group figure is kept, and the policy switches when the
global average's measured cost makes that figure worth it.

The schedule advances once per average, global ones included, so that a window of ``decide_every /
period`` averages, a multiple of the topology-aware schedule's cycle (``intra_steps + 1``), ends where
the schedule crosses the racks: a probe takes the place of a bridge step, which crossed the slow links
anyway, and costs only what a global average costs more than a bridge.

A window counted in steps lasts long when steps become slow (a slowed link makes every global average
slow), so under global averaging every global average inside a window is an *early check*
(``switch_early``): the figures of the last period reach every rank there, and the ranks switch to group
averages when they say so twice in a row, or once by far (:meth:`AdaptiveState.check_early`). By default
they ride along that global average (no collective of the policy's own) and the switch takes effect after
it: a slowed link costs two slow global averages, the one that measured it and the one that carried its
figures. With ``switch_early="exchange"`` the ranks exchange them just before it, in one small allreduce
of their own, and switch that very average: one slow global average, for a small collective before every
global average inside a window (on the bench's two cores for eight ranks, 20-30 ms each). Everything else
waits for the window's end. The PyTorch adapter does this; the Keras adapter, whose traced steps follow a
table made for the whole window, decides at windows' ends only.

The period follows the cost of an average as it moves: it doubles when the chosen mode's average costs
``raise_ratio`` times the least it has cost in this job (per doubling already made), and halves back when
the cost falls to ``lower_ratio`` times it. The optimizer's ``average_every`` is the user's choice for the
network at its best, so the policy keeps it while the network stays as fast as it has been.
"""
import logging
import math
from typing import NamedTuple

import numpy as np

from .policy import BSP, GLOBAL, GROUP, LOCAL

__all__ = ["AdaptivePolicy", "Decision", "decide", "AdaptiveState", "FIGURES", "encode_figures", "decode_figures"]

logger = logging.getLogger("hvd_dssync.adaptive")

# One rank's figures of one window, in this order: the median seconds of a step outside its averaging
# (computing), the fewest seconds of the window's last two global averages (their cost without waits for
# late ranks or a one-off stall: a slow link slows both, and one that slowed inside the window shows at
# its end), the median seconds of a group average (the lower middle one of an even count: of two, one at a
# bridge step, which the ranks that stay in their racks wait for, the other), the largest drift seen (see
# AdaptiveState), and the most seconds of a group average that crossed the racks, of any group average
# where the schedule knows no racks (what stands in for a global average's cost before one was measured:
# see decide; NaN on a rank that crossed none).
FIGURES = ("compute_seconds", "global_seconds", "group_seconds", "drift", "costliest_group_seconds")


def _positive(name, value, integer=True, allow_zero=False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (value >= 0 if allow_zero else value > 0) \
            or not math.isfinite(value):
        rule = ("a non-negative" if allow_zero else "a positive") + (" integer" if integer else " number")
        raise ValueError(f"Arg ``{name}`` must be {rule}, got {value!r}.")
    return value


class AdaptivePolicy:
    """The adaptive policy's settings (``policy="adaptive"`` takes the defaults). Validated here.

    Args:
        decide_every: steps per window; every rank decides at the last step of each window. A multiple
            of every period the policy may choose.
        max_period: the longest averaging period (``average_every``) it may choose; the shortest is the
            optimizer's ``average_every``. Periods double and halve between the two.
        probe_every: under group averaging, the last average of every ``probe_every``-th window is global
            (a probe), so the global figure stays fresh and the policy can decide. The first window has
            none: its group averages stand in for it (see :func:`decide`).
        enter_gain, leave_gain: switch to group averaging when it would make an averaging period at least
            ``enter_gain`` (a fraction) shorter than global averaging; back to global averaging when the
            gain falls below ``leave_gain`` (the gap between the two keeps the policy from flapping).
            A group average mixes the models less than a global one, which the default gain of 30% pays for.
        raise_ratio, lower_ratio: at ``2**k`` times the shortest period, double the period when the chosen
            mode's average costs at least ``raise_ratio * 2**k`` times the least it has cost in this job;
            halve it when at most ``lower_ratio * 2**(k-1)`` times (the gap keeps it from flapping).
        drift_bound: when the largest relative distance between the models of a group before averaging
            (``|x_i - mean| / |mean|``, measured by the averages themselves) exceeds it, the next window
            ends with a global average (a probe), without waiting for the ``probe_every``-th. ``None``: never.
        switch_early: under global averaging, also switch to group averages at a global average inside a
            window, from the figures of the period before it (the least compute time of its steps, the last
            global average's time), when they say so at two such averages in a row, or at one when group
            averages would save at least halfway from ``enter_gain`` to all of a period; so a slowed link is
            answered within periods, not at the window's end (PyTorch; the Keras adapter decides at windows'
            ends only). ``True``: the figures ride along that average, and the switch follows it;
            ``"exchange"``: the ranks exchange them just before it in a small allreduce, and the switch
            makes that very average a group one; ``False``: decide at windows' ends only.
        first_period: the period of the first window, before anything was measured; ``None`` (the default):
            ``max_period``. Its averages are group averages whose cost the ranks do not know yet, and on a
            fast network they cost more than the global ones that follow (Horovod negotiates every process
            set on every cycle), so the first window makes few: with the bench's ``decide_every=16`` and
            ``average_every=4``, two (the last step inside the racks and a bridge) instead of four: 1.03x,
            1.06x and 0.97x the best fixed choice's time on a steady network in three bench runs, against
            1.18x (docs/benchmarks.md). The models drift apart a little more in the first window; every
            later window starts from the shortest period (``average_every``).

    Example::

        >>> AdaptivePolicy(decide_every=16, max_period=4).config()["decide_every"]
        16
        >>> AdaptivePolicy(decide_every=6, max_period=4)
        Traceback (most recent call last):
        ...
        ValueError: Arg ``decide_every`` must be a multiple of every period the policy may choose (1, 2, 4), got 6.
    """

    def __init__(self, decide_every=64, max_period=8, probe_every=4, enter_gain=0.3, leave_gain=0.1,
                 raise_ratio=2.0, lower_ratio=1.5, drift_bound=0.05, min_period=1, switch_early=True,
                 first_period=None):
        self.decide_every = _positive("decide_every", decide_every)
        self.min_period = _positive("average_every", min_period)
        self.max_period = _positive("max_period", max_period)
        if max_period < min_period:
            raise ValueError(f"Arg ``max_period`` must be at least average_every ({min_period}), got {max_period}.")
        self.probe_every = _positive("probe_every", probe_every)
        for name, value in (("enter_gain", enter_gain), ("leave_gain", leave_gain)):
            _positive(name, value, integer=False, allow_zero=True)
            if value >= 1:
                raise ValueError(f"Arg ``{name}`` must be a fraction in [0, 1), got {value!r}.")
        if leave_gain > enter_gain:
            raise ValueError(f"Arg ``leave_gain`` ({leave_gain}) must not exceed ``enter_gain`` ({enter_gain}).")
        for name, value in (("raise_ratio", raise_ratio), ("lower_ratio", lower_ratio)):
            _positive(name, value, integer=False)
            if value <= 1:
                raise ValueError(f"Arg ``{name}`` must be a ratio above 1, got {value!r}.")
        if lower_ratio > raise_ratio:
            raise ValueError(f"Arg ``lower_ratio`` ({lower_ratio}) must not exceed ``raise_ratio`` ({raise_ratio}).")
        self.enter_gain, self.leave_gain = float(enter_gain), float(leave_gain)
        self.raise_ratio, self.lower_ratio = float(raise_ratio), float(lower_ratio)
        self.drift_bound = None if drift_bound is None else float(_positive("drift_bound", drift_bound, integer=False))
        if not (isinstance(switch_early, bool) or switch_early == "exchange"):
            raise ValueError(f"Arg ``switch_early`` must be True, False or 'exchange', got {switch_early!r}.")
        self.switch_early = switch_early
        periods = self.periods()
        self.first_period = self.max_period if first_period is None else _positive("first_period", first_period)
        if self.first_period not in periods:
            raise ValueError(f"Arg ``first_period`` must be one of the periods the policy may choose "
                             f"({', '.join(map(str, periods))}), got {first_period!r}.")
        if any(decide_every % p for p in periods):
            raise ValueError(f"Arg ``decide_every`` must be a multiple of every period the policy may choose "
                             f"({', '.join(map(str, periods))}), got {decide_every}.")

    def periods(self):
        """The periods the policy may choose: ``min_period`` doubled up to ``max_period``."""
        out = [self.min_period]
        while out[-1] < self.max_period:
            out.append(min(2 * out[-1], self.max_period))
        return tuple(out)

    def first_averages(self):
        """The averages of the first window: ``decide_every / first_period``."""
        return self.decide_every // self.first_period

    def config(self):
        return {"decide_every": self.decide_every, "min_period": self.min_period, "max_period": self.max_period,
                "probe_every": self.probe_every, "enter_gain": self.enter_gain, "leave_gain": self.leave_gain,
                "raise_ratio": self.raise_ratio, "lower_ratio": self.lower_ratio, "drift_bound": self.drift_bound,
                "switch_early": self.switch_early, "first_period": self.first_period}

    @classmethod
    def resolve(cls, policy, average_every=1, global_every=0):
        """The settings an optimizer's ``policy`` argument asks for: ``None`` (fixed) or an :class:`AdaptivePolicy`.

        ``policy`` is None or "fixed" (the fixed :class:`hvd_dssync.policy.Policy`), "adaptive" (the
        defaults, at least ``average_every`` steps apart) or an :class:`AdaptivePolicy`; a dict is its
        :meth:`config`. No communication.

        Example::

            >>> AdaptivePolicy.resolve("adaptive", average_every=2).periods()
            (2, 4, 8, 16)
            >>> AdaptivePolicy.resolve("fixed") is None
            True
        """
        if policy is None or policy == "fixed":
            return None
        if policy == "adaptive":
            policy = cls(decide_every=64 * average_every, min_period=average_every, max_period=8 * average_every)
        elif isinstance(policy, dict):
            policy = cls(**policy)
        elif not isinstance(policy, cls):
            raise ValueError(f"Arg ``policy`` must be None, 'fixed', 'adaptive' or an AdaptivePolicy, got {policy!r}.")
        if policy.min_period != average_every:
            policy = cls(**{**policy.config(), "min_period": average_every})
        if global_every:
            raise ValueError("Arg ``global_every`` must be 0 with policy='adaptive': the policy decides when to "
                             "average globally.")
        return policy

    def __repr__(self):
        return "AdaptivePolicy(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"


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
    the others only wait for it, in Horovod's cycles, which negotiate every process set in turn, and in
    three bench runs of twelve the typical rank saw less than 2x its usual average where the bridge ranks
    saw 3x); where the schedule knows no racks, every rank's costliest group average counts. On a fast
    network every group average costs about alike, so the gain is small and the ranks average globally
    from then on; behind a slow link the bridges cost several times the averages inside the racks, and the
    ranks keep group averages until a probe measures a global one.
    An estimate chooses group averages only where the costliest group average costs at least
    ``raise_ratio`` times the typical one as well (what the period takes for a real change of cost): on a
    fast network the costliest is the typical one plus noise and waits (measured: 1.3-1.7x, against
    2.3-2.9x behind a slow link between the racks). Where a global average costs more than that, group
    averages only gain more; where it costs less, the first probe (or a window of global averages) says so.

    Example::

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


def _median(values):
    return float(np.median(values)) if values else float("nan")


def _lower_median(values):
    """The median of ``values``, the lower of the two middle ones for an even count (of a window's two
    group averages, one at a bridge step, the cheaper: what a group average costs where it waits for no
    bridge; see :meth:`AdaptiveState.figures`)."""
    return float(sorted(values)[(len(values) - 1) // 2]) if values else float("nan")


class AdaptiveState:
    """One rank's adaptive policy at run time: the decision in force, this window's measurements, the step
    of the schedule. Adapters call :meth:`action` for each step, send :meth:`carried_figures` along the
    step's average where it returns some, and end the step with :meth:`end_step`, which records it and
    takes what it decides; the order of the two (a probe's own time counts in the figures gathered after
    it, an average that carried the figures belongs to no window) is kept there, once for every adapter.
    With ``switch_early="exchange"`` an adapter that switches inside a window (PyTorch) also exchanges
    :meth:`early_figures`, where a step has some, in a small collective of their own before the step's
    :meth:`action`, and hands every rank's to :meth:`check_early`. ``crosses(schedule_step)`` says whether
    this rank's group at that step of the schedule spans racks (``None``: unknown; see :meth:`figures`).

    Example (four ranks in one process; global averages fast, then slow from step 6; figures exchanged
    before an early check's average)::

        >>> p = AdaptivePolicy(decide_every=4, max_period=1, switch_early="exchange")
        >>> states = [AdaptiveState(p) for _ in range(4)]
        >>> decisions = []
        >>> for step in range(12):
        ...     early = [s.early_figures(step) for s in states]  # one small allreduce, where there are some
        ...     if early[0] is not None:
        ...         switched = [s.check_early(step, np.concatenate(early)) for s in states]
        ...         decisions += [d for d in switched if d is not None]
        ...     kind = states[0].action(step)
        ...     carried = [s.carried_figures(step) for s in states]
        ...     gathered = None if carried[0] is None else np.concatenate(carried)  # what the average carried
        ...     seconds = {"global": 0.5 if step >= 6 else 0.02, "group": 0.01}.get(kind, float("nan"))
        ...     made = [s.end_step(step, kind, seconds, compute_seconds=0.1, gathered=gathered,
        ...                        gather=lambda figures: np.concatenate([figures] * 4))  # the ranks' are alike
        ...             for s in states]
        ...     decisions += [d for d in made if d is not None]
        >>> sorted({(d.step, d.mode, d.period) for d in decisions})  # the same on every rank
        [(3, 'global', 1), (7, 'global', 1), (8, 'group', 1)]
        >>> states[0].action(8)  # the slow average of step 7 switched step 8's already
        'group'
    """

    def __init__(self, policy, warmup_steps=0, crosses=None, first_average=0):
        self.policy = policy
        self.warmup_steps = warmup_steps
        self._crosses = crosses
        self.decision = initial_decision(policy)
        self.averages = first_average  # the schedule's step after warm-up: one more per average
        self._last_global = float("nan")  # the last global average's seconds, across windows, in this mode
        self._early_says_group = False  # the last early check's figures said: group averages
        self._start_window()

    def _start_window(self):
        """Forget the measurements: a new window starts."""
        self._samples = {GLOBAL: [], GROUP: [], "compute": [], "crossing": []}
        self._drift = float("nan")

    def _window(self, step):
        return divmod(step - self.warmup_steps, self.policy.decide_every)

    def action(self, step):
        """What ``step`` does under the decision in force: BSP (warm-up), GLOBAL, GROUP or LOCAL."""
        if step < self.warmup_steps:
            return BSP
        window, at = self._window(step)
        period = self.decision.period
        if (at + 1) % period:
            return LOCAL
        if self.decision.mode == GLOBAL:
            return GLOBAL
        # The last window of every probe_every probes: a switch inside a window, or at its end, then averages
        # in groups for probe_every - 1 windows at least before the next global average.
        probe = window > 0 and (window + 1) % self.policy.probe_every == 0 or \
            self.decision.sync_now and window == self._window(self.decision.step + 1)[0]  # the window after only
        return GLOBAL if probe and at + 1 == self.policy.decide_every else GROUP

    def planned(self, start):
        """``(kind, schedule step)`` of each step of the window that starts at ``start``, under the decision in
        force: what a traced step needs in advance (see :mod:`hvd_dssync.keras.sync`). No state changes."""
        count, out = self.averages, []
        for step in range(start, start + self.policy.decide_every):
            kind = self.action(step)
            out.append((kind, step if step < self.warmup_steps else self.warmup_steps + count))
            count += kind in (GLOBAL, GROUP)
        return out

    def schedule_step(self, step):
        """The step of the schedule for ``step``: it advances once per average, global ones included (a
        probe takes a bridge step's place: see the module's text)."""
        return step if step < self.warmup_steps else self.warmup_steps + self.averages

    def record(self, kind, seconds, compute_seconds=float("nan"), drift=float("nan"), decided=False):
        """Note one step: its kind, its averaging's seconds, its seconds outside the averaging, and the
        relative distance of the models its average saw (NaN where not measured). ``decided``: the step
        was a decision step, whose average carried the figures: its seconds belong to no window."""
        if kind in (GLOBAL, GROUP) and math.isfinite(seconds) and not decided:
            self._samples[kind].append(float(seconds))
            if kind == GROUP and (self._crosses is None or self._crosses(self.warmup_steps + self.averages)
                                  is not False):
                self._samples["crossing"].append(float(seconds))
        if kind in (GLOBAL, GROUP):
            self.averages += 1
        if kind == GLOBAL and math.isfinite(seconds):
            self._last_global = float(seconds)
        if math.isfinite(compute_seconds):
            self._samples["compute"].append(float(compute_seconds))
        if math.isfinite(drift):
            self._drift = drift if not math.isfinite(self._drift) else max(self._drift, drift)

    def is_window_end(self, step):
        """Whether ``step`` is the last of a window (the next one may follow another pattern)."""
        return step >= self.warmup_steps and self._window(step)[1] == self.policy.decide_every - 1

    def is_decision_step(self, step):
        """Whether the ranks decide at ``step``: the last step of a window, when it averages globally (so
        the figures can ride along; see the module's text), and the last step of the first window."""
        return self.is_window_end(step) and (self.action(step) == GLOBAL or self.decision.is_start)

    def rides_along(self, step):
        """Whether the figures of decision step ``step`` ride along its own global average (under global
        averaging: the window's earlier global averages measured the global cost), rather than being
        gathered after it (a probe under group averaging: its global average is the measurement)."""
        return self.is_decision_step(step) and self.decision.mode == GLOBAL

    def carried_figures(self, step):
        """The figures that ``step``'s average carries to every rank (:func:`encode_figures`), or ``None``:
        the window's :meth:`figures` at a decision step under global averaging (:meth:`rides_along`), the
        last period's :meth:`recent_figures` at an early check (:meth:`is_early_check`) whose figures ride
        along (``switch_early=True``)."""
        if self.rides_along(step):
            return self.figures()
        if self.policy.switch_early is True and self.is_early_check(step):
            return self.recent_figures()
        return None

    def early_figures(self, step):
        """With ``switch_early="exchange"``: this rank's :meth:`recent_figures` to exchange with every rank
        before step ``step``'s :meth:`action` when it is an early check (:meth:`is_early_check`), else
        ``None``; every rank's go to :meth:`check_early`."""
        exchange = self.policy.switch_early == "exchange"
        return self.recent_figures() if exchange and self.is_early_check(step) else None

    def end_step(self, step, kind, seconds, compute_seconds=float("nan"), drift=float("nan"), gathered=None,
                 gather=None):
        """Record step ``step`` (as :meth:`record`) and take what it decides; returns the :class:`Decision`
        of a decision step (whether or not mode and period change), the new one where an early check
        switches, else ``None``.

        ``gathered``: every rank's :meth:`carried_figures` (concatenated rows), where the step's average
        carried them. At a decision step they decide (:meth:`conclude`) and the step's seconds, measured
        after the figures left, belong to no window; at an early check they may switch
        (:meth:`check_early`). Without them a decision step (a probe under group averaging, or an
        average that could not carry them) is recorded first, its average's seconds being the freshest
        measurement, and ``gather(figures)`` returns every rank's figures from this rank's :meth:`figures`
        (a collective: every rank calls it at the same decision step).
        """
        decided = self.is_decision_step(step)
        if gathered is None or not (decided or self.is_early_check(step)):
            self.record(kind, seconds, compute_seconds, drift)
            if not decided:
                return None
            if gather is None:
                raise ValueError(f"step {step} is a decision step: end_step needs the figures that rode along "
                                 "its average (gathered) or a way to gather them (gather)")
            return self.conclude(step, np.asarray(gather(self.figures()), dtype=np.float64))
        decision = self.conclude(step, gathered) if decided else self.check_early(step, gathered)
        self.record(kind, seconds, compute_seconds, drift, decided=decided)
        return decision

    def figures(self):
        """This rank's figures of the window, a ``(1, len(FIGURES))`` float64 array: to ride along an average
        (:func:`encode_figures`) or for an allgather. The costliest group average counts only those that
        crossed the racks (``crosses``), or every one where that is unknown."""
        nan = float("nan")
        fewest, costliest = min(self._samples[GLOBAL][-2:], default=nan), max(self._samples["crossing"], default=nan)
        return np.array([[_median(self._samples["compute"]), fewest, _lower_median(self._samples[GROUP]), self._drift,
                          costliest]], dtype=np.float64)

    def is_early_check(self, step):
        """Whether the ranks check at ``step``'s average whether to switch (:meth:`check_early`): under
        global averaging, with ``switch_early``, a global average inside a window."""
        return (self.policy.switch_early and step >= self.warmup_steps and self.decision.mode == GLOBAL
                and not self.is_window_end(step) and self.action(step) == GLOBAL)

    def recent_figures(self):
        """This rank's figures of the last averaging period: the least compute time of its steps (a rank is
        slow when every step of the period was: an evaluation or a stall on one step is no trend), the
        last global average's time (a deciding one included, across windows; NaN before one), and neither
        group figure nor drift (a window of global averages has none: the decision keeps its own)."""
        compute = self._samples["compute"][-self.decision.period:]
        nan = float("nan")
        return np.array([[min(compute, default=nan), self._last_global, nan, nan, nan]], dtype=np.float64)

    def check_early(self, step, gathered):
        """At early check ``step`` (:meth:`is_early_check`; else nothing happens): switch to group averages
        from every rank's ``gathered`` :meth:`recent_figures` (concatenated rows) when :func:`decide` says so
        here and said so at the check before (one slow average is no trend), or says so by far: group
        averages would save at least ``(1 + enter_gain) / 2`` of a period (an average that costs that much
        more hurts at once). Called by :meth:`end_step` with the figures that rode along the step's average
        (the switch follows it), or before the step's :meth:`action` with the :meth:`early_figures` exchanged
        (``switch_early="exchange"``: the switch makes the step's own average a group one). The period stays.
        Returns the new decision (its ``step`` is ``step``), or ``None`` (nothing changes). A switch starts a
        new window of measurements; the windows' steps stay where they were."""
        if not self.is_early_check(step):
            return None
        decision = decide(gathered, self.decision, self.policy, step)
        says_group, self._early_says_group = self._early_says_group, decision.mode == GROUP
        if decision.mode != GROUP or not (says_group or decision.gain >= (1 + self.policy.enter_gain) / 2):
            return None
        self.decision = decision._replace(period=self.decision.period, sync_now=False,
                                          reason=decision.reason.split("; ")[0] + ", inside a window")
        self._start_window()
        self._forget_recent()
        logger.info("hvd_dssync adaptive at step %d: %s averages every %d steps (%s); figures %s", step,
                    self.decision.mode, self.decision.period, self.decision.reason,
                    {k: getattr(self.decision, k) for k in FIGURES})
        return self.decision

    def conclude(self, step, gathered):
        """Take the decision of every rank's ``gathered`` figures (concatenated rows), start a new window."""
        previous = self.decision
        self.decision = decide(gathered, previous, self.policy, step)
        self._start_window()
        if self.decision.mode != previous.mode:
            self._forget_recent()
        changed = (self.decision.mode, self.decision.period) != (previous.mode, previous.period)
        logger.log(logging.INFO if changed or self.decision.sync_now else logging.DEBUG,
                   "hvd_dssync adaptive at step %d: %s averages every %d steps%s (%s); figures %s", step,
                   self.decision.mode, self.decision.period, ", a global average first" if self.decision.sync_now
                   else "", self.decision.reason, {k: getattr(self.decision, k) for k in FIGURES})
        return self.decision

    def state(self):
        """Plain data for a checkpoint: the decision in force and the schedule's step."""
        return {"decision": self.decision.as_dict(), "averages": self.averages}

    _NUMBERS = ("step", "period", "sync_now", "compute_seconds", "global_seconds", "group_seconds", "drift", "gain",
                "share", "global_floor", "group_floor", "costliest_group_seconds")

    def vector(self):
        """:meth:`state` as float64 numbers, for one small broadcast with the step (the reason's words stay)."""
        d = self.decision
        return np.array([float(getattr(d, k)) for k in self._NUMBERS] + [float(d.mode == GROUP), self.averages],
                        dtype=np.float64)

    def load_vector(self, vector):
        """Take the state of another rank's :meth:`vector`; its reason reads "taken from another rank"
        unless it is this rank's own decision.

        Example::

            >>> a, b = AdaptiveState(AdaptivePolicy()), AdaptiveState(AdaptivePolicy())
            >>> a.decision = a.decision._replace(mode=GROUP, period=2, step=63)
            >>> b.load_vector(a.vector()); (b.decision.mode, b.decision.period, b.decision.step)
            ('group', 2, 63)
        """
        vector = np.asarray(vector, dtype=np.float64)
        decision = dict(zip(self._NUMBERS, vector.tolist()))
        decision.update(step=int(decision["step"]), period=int(decision["period"]),
                        sync_now=bool(decision["sync_now"]), mode=GROUP if vector[len(self._NUMBERS)] else GLOBAL,
                        reason=self.decision.reason if self.vector().tobytes() == vector.tobytes()
                        else "taken from another rank")
        self.load({"decision": decision, "averages": int(vector[len(self._NUMBERS) + 1])})

    def load(self, state):
        """Take :meth:`state` (a checkpoint of an earlier version counted group averages only: the same key)."""
        self.decision = Decision(**state["decision"])
        self.averages = int(state["averages"] if "averages" in state else state["group_averages"])
        self._forget_recent()
        self._start_window()

    def _forget_recent(self):
        """Forget the figures that span windows (the mode changed, or a checkpoint was loaded)."""
        self._last_global, self._early_says_group = float("nan"), False


# Figures travel as whole numbers of this unit (10 us, or 1e-5 of drift), each below 2**23, so that in
# float32 a slot holding one rank's number and zeros elsewhere sums to that number exactly in any order.
_UNIT, _CAP = 1e-5, 2 ** 23 - 1


def encode_figures(figures, rank, size):
    """``figures`` (one rank's row, :data:`FIGURES`' order) in this rank's slots of a vector of ``size``
    rows, zeros elsewhere: averaged (or summed) over the ranks, it holds every rank's row
    (:func:`decode_figures`), and every rank reads the same numbers. NaN travels as -1.

    Example::

        >>> v = sum(encode_figures([[0.01, 0.2, float("nan"), 0.003, 0.05]], r, 2) for r in range(2)) / 2
        >>> decode_figures(v, 2, averaged=True)[1].tolist()
        [0.01, 0.2, nan, 0.003, 0.05]
    """
    row = np.asarray(figures, dtype=np.float64).reshape(len(FIGURES))
    units = np.where(np.isfinite(row), np.minimum(np.round(np.nan_to_num(row) / _UNIT), _CAP), -1.0)
    out = np.zeros((size, len(FIGURES)))
    out[rank] = np.maximum(units, -1.0)
    return out.reshape(-1)


def decode_figures(vector, size, averaged=False):
    """Every rank's figures, ``(size, len(FIGURES))``, from the slots of :func:`encode_figures` summed over
    the ranks (``averaged``: divided by ``size``, as an average returns them).

    Example::

        >>> decode_figures(encode_figures([[0.5, float("nan"), 0.25, 0.0, 0.25]], 0, 1), 1).tolist()
        [[0.5, nan, 0.25, 0.0, 0.25]]
    """
    units = np.round(np.asarray(vector, dtype=np.float64).reshape(size, len(FIGURES)) * (size if averaged else 1))
    return np.where(units < 0, np.nan, units * _UNIT)


def drift_of(mean_square_norm, averaged_square_norm):
    """The relative distance of a group's models before they were averaged, from two numbers every
    member has after the average: the members' mean squared norm and the averaged model's squared norm.

    ``mean_i |x_i|^2 - |mean x|^2`` is the mean squared distance to the mean, so the drift is its root over
    ``|mean x|`` (float32 sums resolve about 3e-4). No communication.

    Example::

        >>> round(drift_of((1.0 + 9.0) / 2, 4.0), 3)   # models 1 and 3: mean 2, each 1 away
        0.5
    """
    spread = max(float(mean_square_norm) - float(averaged_square_norm), 0.0)
    return math.sqrt(spread) / max(math.sqrt(float(averaged_square_norm)), 1e-30)


__all__ += ["initial_decision", "drift_of"]
