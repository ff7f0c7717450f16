"""Whether the default hides its averages behind compute (``overlap=None``): decided by measurement.

An overlapped average runs behind the local steps that follow it and is folded in once done (the PyTorch
adapter's ``overlap``). It wins where a step's compute leaves the host's cores and NIC idle (a GPU's forward
and backward pass), and loses where the ranks' compute already fills the cores (the averaging then competes
with it and is folded in stale for nothing). Rather than guess which from the machine, the optimizer times
it: after the warm-up and one averaging period of set-up, :data:`TRIAL_PERIODS` averaging periods or more
(whole cycles of the schedule, each place of the cycle at least twice: :func:`replicates`) with the averages
waited for, as many overlapped, each period's seconds on each rank (an allgather where it decides: every
rank decides alike). Overlap stays on where the saving less :data:`MIN_T` standard errors is still
:data:`MIN_GAIN` of a waited period; else off, the safe choice (exact averages, no staleness): unsure is
off. A first look after the first overlapped cycle ends the trial early where that cycle saved less than
:data:`MIN_GAIN` (an overlapped average is folded in a period late: each overlapped period costs the
ranks' models some accuracy, spent for nothing where overlap does not pay). The trial weighs the steps'
time alone, not what a stale average costs each step. ``overlap=True`` or ``False`` decides without a
trial; so does a job on one host (:func:`runs_trial`), where it stays off.

Where the schedule's global averages may go either way (the topology-aware schedule's ``global_via_bridges
="auto"``: through the racks, waited for, or over every rank at once, behind the steps), a probe after the set-up
period chooses (:meth:`OverlapTrial.decide_globals`) and both halves send them that way: no waited route is timed
where the fragments hide it. A global average in flight is folded in a step after it started (:func:`folds_now`), so
it goes in fragments (:mod:`hvd_dssync.fragments`), each a ring that fits behind a local step; the route where even
a period's fragments would leave more exposed than it costs. The trial then keeps the fragments unless they cost more
than the route's price beyond the noise, the other averages (the racks', the bridges) where their places of the cycle
saved :data:`MIN_GAIN` in the share of a period after which the overlapped half folded them in (:func:`staleness`),
beyond the noise (:meth:`OverlapTrial.decide`). The fragments, where chosen, are warmed first, untimed
(:meth:`OverlapTrial.warms`). Where the racks' period is the default's, a probe of whether their averages hide at
half of it comes first, and may end the trial (:mod:`hvd_dssync.rhythm`: :attr:`OverlapTrial.average_every`).

Numpy only; the adapter times its steps and supplies the allreduce.
"""
import math
import time

import numpy as np

from .fragments import GLOBAL_FOLD_STEPS, global_fragments
from .rhythm import HidingProbe, averages_cycle, global_places, hides_maybe, quickened_every, replicates, staleness

__all__ = ["OverlapTrial", "folds_now", "runs_trial", "replicates", "averages_cycle", "global_places", "staleness",
           "quickened_every", "TRIAL_PERIODS", "MIN_GAIN", "MIN_T"]

TRIAL_PERIODS = 4  # averaging periods timed each way
MIN_GAIN = 0.05  # overlap must shorten the mean step by this share to be kept,
# ... less this many standard errors of the saving: with 3 degrees of freedom (the fewest a trial leaves,
# replicates), Student's t one-sided at 95% is 2.35.
MIN_T = 2.5
# The fragments' count from a probe's ring: each ring in flight may take this many times as long as the probe's alone
# (it shares the host with the compute and the folds): on 2 shared cores, 5-6 fragments that the probe said would each
# hide behind a step left each fold 0.03-0.15 s to wait for.
IN_FLIGHT_HEADROOM = 2.0


def folds_now(kind, started, step, done):
    """Whether local step ``step`` folds in the average in flight of ``kind`` (its action's) that started at step
    ``started`` (``done``: a poll found it done): where it is done, and for a global average (or a fragment of
    one: :mod:`hvd_dssync.fragments`) ``GLOBAL_FOLD_STEPS`` steps after it started at the latest, waited for
    where it is not done. A rack's average in flight may run until the next average starts. A global average
    may not: the racks drifted apart since the last one (``global_every`` steps, not a period), and each step
    taken from those models before the fold keeps the ranks apart after it: folded a period late, the synthetic
    parity task's rank 0 lost 2-3 points against Horovod's optimizer; one step late, it kept parity
    (docs/tuning.md).

    Example::

        >>> folds_now("group", 1, 2, done=False), folds_now("global", 7, 8, done=False)
        (False, True)
        >>> folds_now("group", 1, 2, done=True)
        True
    """
    from .policy import GLOBAL
    return bool(done) or (kind == GLOBAL and step - started >= GLOBAL_FOLD_STEPS)


def runs_trial(overlap, lossy_compression, adaptive, world_size, several_hosts):
    """Whether an optimizer decides by a trial: ``overlap`` is None (the default), its averages cross hosts
    (``several_hosts``: on one host an average is a copy between processes, with little to hide and the
    host's cores to share), it runs among several ranks, and nothing rules overlap out (a lossy compression,
    the adaptive policy, which times the averages itself). Where it is False, overlap is off.

    Example::

        >>> runs_trial(None, False, False, 8, True), runs_trial(None, False, False, 8, False)
        (True, False)
        >>> runs_trial(True, False, False, 8, True)   # forced on: no trial
        False
    """
    return overlap is None and not lossy_compression and not adaptive and world_size > 1 and several_hosts


def _shorter(overlapped, waited):
    """The share by which the ``overlapped`` periods were shorter than the ``waited`` ones (NaN: nothing timed)."""
    return 1.0 - overlapped.mean() / waited.mean() if waited.mean() > 0 else math.nan


class OverlapTrial:
    """The trial of one optimizer. ``start``: the first step after the warm-up; ``period``: steps between two
    averages; ``cycle``: the averages after which the schedule's kinds of average repeat (the topology-aware
    schedule's rack averages and its bridge: ``intra_steps + 1``), so that each way is timed over as many
    averages of each kind (whole cycles, at least ``periods`` averages, each place of the cycle at least
    twice, :func:`replicates`). The ranks gather their figures at :attr:`look` (after the first overlapped
    cycle: :meth:`decide` with ``early=True`` ends the trial where it saved too little) and at :attr:`last`.
    ``globals_at``: the averaging periods of each half that hold a global average whose way the trial chooses
    (:func:`global_places`; none: no choice, :attr:`global_fragments` stays 0); then the ranks gather at the
    set-up period's last step too, the adapter's probe timed (:meth:`decide_globals`). ``through_racks``: a waited
    global average takes the route through the racks (the PyTorch adapter's), else it is the ring over every rank
    (the Keras adapter's).

    Example::

        >>> trial = OverlapTrial(start=0, period=1)
        >>> OverlapTrial(start=0, period=4, cycle=4).length   # twice the racks' three averages and the bridge
        32
        >>> [trial.overlap_at(s) for s in range(10)]
        [False, False, False, False, False, True, True, True, True, True]
        >>> for s in range(10):
        ...     trial.note(s, 0.3 if s < 5 else 0.2)
        >>> trial.look, trial.due(5), trial.due(8), trial.figures().tolist()
        (5, True, True, [[0.3, 0.3, 0.3, 0.3, 0.2, 0.2, 0.2, 0.2, 0.0, 0.0]])
        >>> trial.decide([[0.3, 0.31, 0.3, 0.32, 0.2, 0.21, 0.2, 0.2], [0.31, 0.3, 0.3, 0.3, 0.21, 0.2, 0.2, 0.2]])
        True
        >>> trial.overlap_at(10)
        True
    """

    def __init__(self, start, period, cycle=1, periods=TRIAL_PERIODS, min_gain=MIN_GAIN, globals_at=(), world_size=2,
                 through_racks=True, hiding=False):
        self.period = max(1, int(period))
        # hiding: a probe of whether the racks' averages hide comes first (hvd_dssync.rhythm), the trial after it.
        self.hiding = HidingProbe(start, self.period) if hiding else None
        self._setup_start = int(start)  # the set-up period: the global averages' probe at its end
        self.cycle = max(1, int(cycle))
        self.blocks = self.cycle * replicates(periods, self.cycle)  # averaging periods timed each way
        self.length = self.period * self.blocks
        self._place((self.hiding.end if hiding else int(start)) + self.period)  # one period of set-up untimed
        self._plain = (int(start) + self.period, ())  # where it goes where the probe is called off (_call_off)
        self.min_gain = float(min_gain)
        self.decided = None  # True / False once decided
        self.gain = math.nan
        self.early = False  # decided at the first look
        self._seconds = np.zeros(2 * self.blocks)  # each period's seconds: waited ones, then overlapped ones
        self.globals_at = tuple(int(k) for k in globals_at)
        self.world_size = int(world_size)  # the ranks a global average's ring runs over
        self.through_racks = bool(through_racks)
        self.global_fragments = 0  # the global averages in flight, in this many fragments (0: the route)
        self._setup = []  # the set-up period's local steps' seconds: a local step, for decide_globals
        self.probe = self.local_step = math.nan  # what decide_globals weighed
        self._bridge = math.nan  # what the probe priced the route's bridge at
        self._rack = 0.0  # what a rack's average waited for cost, where the route goes through the racks (decide)
        self.exposure = math.nan  # what the fragments left exposed a global average (decide)
        self._last_end = None  # when the step before ended (step_ended)
        self._folds = np.zeros(2)  # the overlapped half's averages in flight but the global ones: steps, how many
        self.staleness = math.nan  # after how many steps those were folded in (decide: staleness), where told
        self.quickens = False  # the period is the default's: the racks may average more often where they hide
        self.racks_every = None  # decide: the racks' period from the next period on, where quickened (rhythm)
        self.average_every = self.period  # the racks' period it asks for now

    @classmethod
    def of(cls, plan, choose_globals=False, through_racks=True, quickens=False):
        """The trial of an optimizer's :class:`hvd_dssync.plan.SyncPlan` (or of anything with its ``policy``,
        ``schedule`` and ``action``, as both adapters' optimizers have): after its warm-up, one period per
        average, whole cycles of its averages' kinds (:func:`averages_cycle`). ``choose_globals``: the global
        averages may go either way (:meth:`decide_globals`), waited (``through_racks`` or not) or in flight.
        ``quickens``: the averaging period is the default's: a probe of whether the racks' averages hide at half of
        it comes first (:attr:`hiding`), and :meth:`decide` may halve it too (:mod:`hvd_dssync.rhythm`)."""
        policy = plan.policy
        hiding = bool(quickens) and policy.average_every >= 4 and policy.average_every % 2 == 0
        trial = cls(policy.warmup_steps, policy.average_every,
                    averages_cycle(plan.schedule.cycle, policy.average_every, policy.global_every),
                    world_size=plan.schedule.world_size, through_racks=through_racks, hiding=hiding)
        if choose_globals:
            trial.globals_at = global_places(plan, trial.first, trial.period, trial.blocks)
            trial._plain = (trial._plain[0], global_places(plan, trial._plain[0], trial.period, trial.blocks))
        elif hiding:  # no probe of the global averages' way to start the racks' from: none
            trial._call_off()
        trial.quickens = bool(quickens)
        return trial

    def _place(self, first):
        """The trial's halves from step ``first`` on."""
        self.first = first
        self.look = self.first + self.length + self.period * self.cycle - 1  # after the first overlapped cycle

    def _call_off(self):
        """No probe of the racks' period: the trial right after the set-up period, as where none was asked for."""
        self.hiding = None
        self._place(self._plain[0])
        self.globals_at = self._plain[1]

    @property
    def _probe_step(self):
        """The set-up period's last step, where the ranks probe the way of the global averages and choose it (None: no
        choice)."""
        return self._setup_start + self.period - 1 if self.globals_at else None

    @property
    def last(self):
        """The trial's last step, where it decides."""
        return self.first + 2 * self.length - 1

    def overlap_at(self, step):
        """Whether ``step``'s average is overlapped."""
        if self.decided is not None:
            return self.decided
        if self.hiding is not None and self.hiding.in_flight(step):
            return True
        return step >= self.first + self.length

    def note(self, step, seconds, local=False):
        """A step's seconds, from the end of the step before to the end of this one; ``local``: a step with no
        average (counted apart in the set-up period, for :meth:`decide_globals`)."""
        if not math.isfinite(seconds) or self.decided is not None:
            return
        if local and self._setup_start <= step < self._setup_start + self.period:
            self._setup.append(float(seconds))
        if self.first <= step <= self.last:
            block = (step - self.first) // self.period
            self._seconds[block] += float(seconds)

    def note_fold(self, step, kind, started):
        """An average in flight of ``kind``, started at step ``started``, was folded in at ``step``: in the
        overlapped half, what :meth:`decide` weighs the other averages' saving against (:func:`staleness`). A global
        average's fragments are folded in a step after they started (:func:`folds_now`): not counted."""
        from .policy import GLOBAL
        if self.decided is None and kind != GLOBAL and self.first + self.length <= started <= self.last:
            self._folds += (step - started, 1)
        if self.decided is None and kind != GLOBAL and self.hiding is not None:
            self.hiding.note_fold(step, started)

    def due(self, step):
        """Whether the ranks gather their figures after ``step`` and decide (:meth:`figures`, then
        :meth:`decide`; at :attr:`look`, early)."""
        hiding = None if self.hiding is None else self.hiding.step
        return self.decided is None and step in (self.look, self.last, self._probe_step, hiding)

    def step_ended(self, step, gather, local=False, warm=None, folded=None, probe=None):
        """What an adapter calls at the end of each step (``local``: one with no average; ``folded``: the kind and
        start step of an average in flight this step folded in, :meth:`note_fold`): notes the step's
        seconds, from the end of the step before; where :meth:`due`, decides from ``gather(figures)``, the
        adapter's allgather of :meth:`figures` over the optimizer's ranks (a collective, at the same step on
        every rank): overlap at the look and the last step; at the set-up period's last step the global averages'
        way, from ``gather(probe_figures(probe(fragments)))`` (``probe``: the adapter's seconds of one ring over the
        optimizer's ranks of the first of that many fragments of the model, after an untimed one; none: unsure, the
        route). Where :meth:`warms` says, ``warm(fragments)`` (the adapter's op of the first of that many fragments,
        every rank at the same step), untimed. Returns the decision on overlap taken at this step, or None."""
        now = time.perf_counter()
        if self._last_end is not None:
            self.note(step, now - self._last_end, local)
        if folded is not None:
            self.note_fold(step, *folded)
        decided = None
        if self.due(step):
            if step == self._probe_step:
                self.decide_globals(gather(self.probe_figures(math.nan if probe is None else probe(self.period))))
            elif self.hiding is not None and step == self.hiding.step:
                decided = self.decide_hiding(gather(self.hiding.folds.reshape(1, -1)))
            else:
                decided = self.decide(gather(self.figures()), early=step < self.last)
        if self.hiding is not None and step >= self.hiding.step and not self.hiding.done:
            self.hiding.done = True  # decided, or missed (a job resumed past it): the period as built where not hid
            if self.hiding.racks_every is None:
                self.average_every = self.period
        way = self.warms(step)
        if warm is not None and way is not None:
            warm(way)
        self._last_end = time.perf_counter()
        return decided

    def warms(self, step):
        """The fragments' count where the adapter warms them at the end of ``step``, untimed, or None: right after the
        probe chose them (one op of the first fragment: a ring's first op of a size cost the bench's first fragments
        0.2-0.3 s more a fold than the next). The route is not warmed: on the static headline its first average cost
        what the next did (0.39 s against 0.41 s unwarmed), and an op of zeros across the racks cost a step 0.15 s.

        Example::

            >>> trial = OverlapTrial(start=0, period=8, cycle=4, globals_at=(2, 6), world_size=4)
            >>> warmed = lambda: [(s, trial.warms(s)) for s in range(140) if trial.warms(s) is not None]
            >>> waited = warmed(); trial.global_fragments = 6   # then the probe chose 6 fragments
            >>> waited, warmed()
            ([], [(7, 6)])
        """
        if not self.globals_at or self.decided is not None or not self.global_fragments:
            return None
        return self.global_fragments if step == self._probe_step else None

    def figures(self):
        """This rank's seconds of each averaging period of the trial, the waited ones first, then the overlapped half's
        folds (:meth:`note_fold`: steps summed, how many): one row."""
        return np.concatenate([self._seconds, self._folds]).reshape(1, -1)

    def probe_figures(self, seconds):
        """This rank's figures for :meth:`decide_globals`: the probe's ``seconds``, the median of the set-up period's
        local steps (NaN where none was timed): one row."""
        return np.array([[float(seconds), float(np.median(self._setup)) if self._setup else math.nan]])

    def _folds_of(self, gathered):
        """The ranks' folds (:meth:`figures`' last two columns), none where the rows hold the periods alone."""
        rows = np.asarray(gathered, dtype=float)
        width = 2 * self.blocks
        return rows[:, width:width + 2] if rows.shape[1] >= width + 2 else np.zeros((0, 2))

    def decide_hiding(self, gathered):
        """From every rank's folds of the probe of whether the racks' averages hide (:attr:`hiding`: a row each):
        where they hid, overlap on, the racks every half period, and the trial ends (the global averages' way as
        :meth:`decide_globals` chose it, not timed against the route); else None: the trial goes on after it."""
        rows = np.asarray(gathered, dtype=float).reshape(-1, 2)
        self.staleness = staleness(rows, self.period) if rows[:, 1].sum() > 0 else math.nan
        if self.hiding.decide(rows) is None:
            return None
        self.racks_every = self.average_every = self.hiding.racks_every
        self.decided = True
        return True

    def decide_globals(self, gathered):
        """From every rank's :meth:`probe_figures` at the end of the set-up period: how many fragments the global
        averages go in, over every rank at once, behind the steps (:func:`~hvd_dssync.fragments.global_fragments`), or
        0: waited for (through the racks; where the adapter has no route, over every rank). The probe timed a ring over
        every rank of a period's fragment of the model: the whole model's takes the period's times that (a fragment's
        fixed costs make it no less); the route's bridge sends ``2 (w - 1) / w`` times fewer bytes across the racks
        than that ring over ``w`` ranks (:attr:`route_cost`, until :meth:`decide` adds a rack's average; where the
        adapter has no route, the ring itself). What could hide each fragment is the ``GLOBAL_FOLD_STEPS`` local steps
        before its fold (:func:`folds_now`). The medians over the ranks (a rank that entered the probe late timed
        less); NaN (nothing timed) keeps them waited.

        Example::

            >>> trial = OverlapTrial(start=0, period=8, cycle=4, globals_at=(2, 6), world_size=4)
            >>> trial.decide_globals([[0.12, 0.13], [0.11, 0.14], [0.12, 0.13], [0.12, 0.13]])   # a slow link
            8
            >>> round(trial.route_cost, 2), trial.local_step
            (0.64, 0.13)
            >>> trial.decide_globals([[0.008, 0.13]] * 4), trial.decide_globals([[0.09, 0.012]] * 8)  # fast; static
            (1, 0)
        """
        rows = np.asarray(gathered, dtype=float).reshape(-1, 2)
        self.probe = float(np.median(rows[:, 0])) if np.isfinite(rows[:, 0]).all() else math.nan
        self.local_step = float(np.median(rows[:, 1])) if np.isfinite(rows[:, 1]).all() else math.nan
        share = 2.0 * (self.world_size - 1) / self.world_size if self.through_racks and self.world_size > 1 else 1.0
        self._bridge = self.probe * self.period / share
        self.global_fragments = global_fragments(self._bridge, self.local_step, self.world_size, self.period,
                                                 self.through_racks, IN_FLIGHT_HEADROOM)
        if self.hiding is not None and hides_maybe(self.probe, self.local_step):
            self.average_every = self.hiding.every  # the probe of the racks' period from the next step
        elif self.hiding is not None:
            self._call_off()
        return self.global_fragments

    @property
    def route_cost(self):
        """What the route costs a global average by the probe: its bridge (:meth:`decide_globals`), and once
        :meth:`decide` timed one, a rack's average waited for (where the route goes through the racks)."""
        return self._bridge + self._rack

    @property
    def globals_in_flight(self):
        """Whether the trial chose the global averages in flight (:attr:`global_fragments`)."""
        return self.global_fragments > 0

    def _kinds(self):
        """The places of the cycle of the global averages in fragments (their place and the next, which holds their
        folds) where the trial sent them so, then the others' (the racks' averages, the bridges); else none, then
        every place."""
        if not self.global_fragments:
            return (), tuple(range(self.cycle))
        places = {k % self.cycle for k in self.globals_at}
        places |= {(k + 1) % self.cycle for k in places}
        return tuple(sorted(places)), tuple(k for k in range(self.cycle) if k not in places)

    def _exposed(self, periods):
        """What the fragments cost a global average, what a rack's average waited for cost its period, and the first's
        standard error (NaN where no other place was timed, or under two cycles), from every rank's periods
        (``periods``: a row each, the cycles timed in order, the waited half's first). A cycle's cost: its seconds
        less its places at the pace of its others' places (a rack's average and its period's steps each, as the
        route's place would be with the route's bridge in place of the rack's average), over the ranks; with a rack's
        average, what the route would cost beside it. The median over the cycles timed, both halves' (a way's first
        averages cost more: on the bench the first cycle took 0.5-0.6 s more than the next)."""
        places, others = self._kinds()
        if not places or not others:
            return math.nan, math.nan, math.nan
        cycles = periods.mean(axis=0).reshape(-1, self.cycle)
        cycles = cycles[(cycles > 0).all(axis=1)]  # the cycles timed (at the first look, one overlapped)
        pace = cycles[:, list(others)].mean(axis=1)  # each cycle's period of the others' places
        rack = np.median(pace[:self.blocks // self.cycle]) - self.period * self.local_step  # the waited half's first
        rack = max(0.0, float(rack)) if math.isfinite(rack) else 0.0
        costs = (cycles.sum(axis=1) - self.cycle * pace) / len({k % self.cycle for k in self.globals_at})
        if costs.size < 2:
            return math.nan, math.nan, math.nan
        return float(np.median(costs)) + rack, rack, float(costs.std(ddof=1) / math.sqrt(costs.size))

    def decide(self, gathered, early=False):
        """From every rank's :meth:`figures` (rows): keep overlap where it shortened the ranks' mean step by
        ``min_gain`` or more, and by more than the noise. Where the global averages went in fragments, their places of
        the cycle (:meth:`_kinds`) decide the fragments alone: kept unless they cost more than the route's price beyond
        the noise (:meth:`_keep_fragments`; both ways are exact: a wrong choice costs as much time as they differ).
        The others (the racks' averages, the bridges; every place where the global averages take the route)
        are kept where their places saved ``min_gain`` times the share of a period after which they were folded in
        (:func:`staleness`: all of it where none was told), less :data:`MIN_T` standard errors. The saving of each
        averaging period is the waited period's seconds less the overlapped one's at the same place in the cycle,
        averaged over the ranks (what their noise shares, as where they wait for each other, stays in it); its noise is
        read from the periods of the same place (a bridge saves more than a rack's average, which is no noise).
        Where the trial :attr:`quickens` and the others were folded in within a quarter of their period, the racks
        average twice as often from the next period, in flight (:attr:`racks_every`: :mod:`hvd_dssync.rhythm`).
        Returns the decision on the averages but the global ones (None where the first look lets the trial go on).

        ``early``: the first look, at :attr:`look`, with one overlapped cycle timed: off where the others' places
        saved less than their share of their waited periods in that cycle (unsure is off), on where the racks
        hid (:attr:`racks_every`), the fragments decided on what was timed; else None, the trial goes on.
        """
        periods = np.asarray(gathered, dtype=float)[:, :2 * self.blocks].reshape(-1, 2, self.blocks)
        waited, overlapped = periods[:, 0, :], periods[:, 1, :]
        others = self._kinds()[1]
        # The others are folded in once done: on a host whose cores are free, a step or two after they start.
        folds = self._folds_of(gathered)
        stale = staleness(folds, self.period)
        self.staleness = stale if folds[:, 1].sum() > 0 else math.nan
        # Where they hid (folded in within a quarter of the period), the racks average twice as often, in flight.
        self.racks_every = quickened_every(folds, self.period) if self.quickens else None
        self.average_every = self.racks_every or self.period
        others_gain = self.min_gain * stale / self.period
        by_place = waited.mean(axis=0).reshape(-1, self.cycle).mean(axis=0)  # a waited period's seconds, each place
        if early:
            # The first overlapped cycle holds each place once, set against the waited periods of the same place.
            first = by_place - overlapped[:, :self.cycle].mean(axis=0)
            saved = others and first[list(others)].sum() >= others_gain * by_place[list(others)].sum()
            if saved and self.racks_every is None:  # where the racks hide, the trial ends here, whatever they saved
                return None
            self.gain = _shorter(overlapped[:, :self.cycle], waited)
            self.decided, self.early = self.racks_every is not None, True
            self._keep_fragments(periods)
            return self.decided
        self.gain = _shorter(overlapped, waited)
        saved = (waited - overlapped).mean(axis=0).reshape(-1, self.cycle)  # a row per cycle, a column per place
        freedom = saved.size - self.cycle
        variance = ((saved - saved.mean(axis=0)) ** 2).sum() / freedom if freedom > 0 else math.inf
        self._keep_fragments(periods)
        if not others or not math.isfinite(self.gain):
            self.decided = self.racks_every is not None
            return self.decided
        places = list(others)
        error = math.sqrt(len(places) * variance / saved.shape[0])
        self.decided = bool(saved[:, places].sum(axis=1).mean() - MIN_T * error >= others_gain * by_place[places].sum()
                            or self.racks_every is not None)
        return self.decided

    def _keep_fragments(self, periods):
        """Keep the global averages' fragments, which the probe chose, unless they cost more than the route beyond the
        noise (:data:`MIN_T` standard errors; :meth:`decide`); else the route (:attr:`global_fragments` 0). The route's
        price (:attr:`route_cost`) takes in a rack's average where it goes through the racks (it averages in the racks,
        then across, then in them again): a bound from below (its three ops also wait for each other)."""
        if not self.global_fragments:
            return
        self.exposure, rack, error = self._exposed(np.concatenate([periods[:, 0, :], periods[:, 1, :]], axis=1))
        if self.through_racks and math.isfinite(rack):
            self._rack = rack
        if not self.exposure - MIN_T * error <= self.route_cost:
            self.global_fragments = 0

    @property
    def overlapping(self):
        """Whether any average runs in flight after the trial (the global ones' fragments included); None during
        it."""
        return None if self.decided is None else bool(self.decided or self.global_fragments)

    def fragments_at(self, step):
        """In how many fragments ``step``'s global average, if it has one, goes in flight (:meth:`decide_globals`,
        :meth:`decide`): none before the probe; 0: through the racks."""
        return self.global_fragments

    def rule_out(self):
        """Overlap cannot run here (sparse averaging in use, which every rank agreed on): off, no trial."""
        self.decided = False

    def describe(self):
        if self.decided is None:
            return "overlap: on trial"
        hid = self.hiding is not None and self.hiding.racks_every is not None
        if math.isnan(self.gain) and not hid:
            return f"overlap {'on' if self.overlapping else 'off'} (no trial)"
        cycle = ", its first overlapped cycle" if self.early else ""
        way = ""
        if math.isfinite(self.route_cost):
            flight = "over every rank, in flight" + (f", in {self.global_fragments} fragments"
                                                     if self.global_fragments > 1 else "")
            waited, cost = ("through the racks", "the route") if self.through_racks else ("waited", "one waited")
            exposed = f", the fragments {self.exposure:.2g} s" if math.isfinite(self.exposure) else ""
            way = (f"; global averages {flight if self.globals_in_flight else waited}: a fragment's ring "
                   f"{self.probe:.2g} s, {cost} priced {self.route_cost:.2g} s{exposed}, a local step "
                   f"{self.local_step:.3g} s")
        kinds = ""
        if self.decided != self.overlapping:
            kinds = ", the global averages' fragments only"
        change = f"{self.gain:.0%} shorter" if self.gain >= 0 else f"{-self.gain:.0%} longer"
        change = "the racks' averages hid in flight" if hid else f"the overlapped steps {change}"
        stale = (f"; the others folded in {self.staleness:.2g} step{'' if self.staleness == 1 else 's'} late"
                 if math.isfinite(self.staleness) else "")
        if self.racks_every is not None:
            stale += f": the racks every {self.racks_every} steps from " + (f"step {self.hiding.first}" if hid else
                                                                          "the next period")
        return f"overlap {'on' if self.overlapping else 'off'}{kinds} ({change}{cycle}{way}{stale})"
