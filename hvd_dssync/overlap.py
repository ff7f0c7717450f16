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
="auto"``: through the racks, waited for, or over every rank at once, behind the steps), the waited half
decides that too, before the overlapped half times it (:meth:`OverlapTrial.decide_globals`). A global average
in flight is folded in a step after it started (:func:`folds_now`: a later fold costs the ranks' models
accuracy), and a ring over every rank crosses the slow link as the route does, with more bytes. So it goes in
fragments (:mod:`hvd_dssync.fragments`): as many parts of the model, each sent at a step
of its own and folded in at the next, as it takes for each ring to fit behind a local step, at most one a step
until the next average; the route where what even those steps leave exposed would cost more than the route.
Unsure (nothing timed) is the route. The overlapped half then decides each kind on its own
(:meth:`OverlapTrial.decide`): the fragments on what their places of the cycle saved, the racks' averages
on theirs (on 2 shared cores a rack's average in flight cost more than waited, while the fragments hid the
route's slow link). The fragments, folded in a step late and not a period, need save only a period's share of
:data:`MIN_GAIN`, by the mean (both ways are exact: a wrong choice costs as much time as they differ). The other
averages are folded in once done: they need save :data:`MIN_GAIN` in the share of a period after which the
overlapped half folded them in (:func:`staleness`: a period where nothing was told), beyond the noise. Before
each half's first global average the adapter warms that half's way
(:meth:`OverlapTrial.warms`), untimed: a way's first average cost more than the next.

Numpy only; the adapter times its steps and supplies the allreduce.
"""
import math
import time

import numpy as np

from .fragments import GLOBAL_FOLD_STEPS, global_fragments

__all__ = ["OverlapTrial", "folds_now", "runs_trial", "replicates", "averages_cycle", "global_places", "staleness",
           "TRIAL_PERIODS", "MIN_GAIN", "MIN_T"]

TRIAL_PERIODS = 4  # averaging periods timed each way
MIN_GAIN = 0.05  # overlap must shorten the mean step by this share to be kept,
# ... less this many standard errors of the saving: with 3 degrees of freedom (the fewest a trial leaves,
# replicates), Student's t one-sided at 95% is 2.35.
MIN_T = 2.5


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


def replicates(periods, cycle):
    """How many times a trial times each place of the schedule's cycle each way: enough for ``periods``
    averaging periods, and for 3 or more degrees of freedom left to the noise once each place's own mean is
    taken out (:meth:`OverlapTrial.decide`).

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


def staleness(folds, period):
    """After how many steps the overlapped half folded in its averages in flight but the global ones, from every
    rank's ``(steps summed, averages)`` (:meth:`OverlapTrial.note_fold`): the largest of the ranks' means, at least
    ``GLOBAL_FOLD_STEPS``, at most ``period``; ``period`` where no rank folded one in (unsure: as late as the next
    average, the latest an average in flight may be folded in).

    Example::

        >>> staleness([[3, 3], [4, 3]], 8), staleness([[30, 3]], 8), staleness([[0, 0], [0, 0]], 8)
        (1.3333333333333333, 8.0, 8.0)
    """
    folds = np.asarray(folds, dtype=float).reshape(-1, 2)
    means = [steps / count for steps, count in folds if count > 0]
    return float(min(max(max(means), GLOBAL_FOLD_STEPS), period)) if means else float(period)


def _shorter(overlapped, waited):
    """The share by which the ``overlapped`` periods were shorter than the ``waited`` ones, on average (NaN where
    nothing was timed)."""
    return 1.0 - overlapped.mean() / waited.mean() if waited.mean() > 0 else math.nan


class OverlapTrial:
    """The trial of one optimizer. ``start``: the first step after the warm-up; ``period``: steps between two
    averages; ``cycle``: the averages after which the schedule's kinds of average repeat (the topology-aware
    schedule's rack averages and its bridge: ``intra_steps + 1``), so that each way is timed over as many
    averages of each kind (whole cycles, at least ``periods`` averages, each place of the cycle at least
    twice, :func:`replicates`). The ranks gather their figures at :attr:`look` (after the first overlapped
    cycle: :meth:`decide` with ``early=True`` ends the trial where it saved too little) and at :attr:`last`.
    ``globals_at``: the averaging periods of each half that hold a global average whose way the trial chooses
    (:func:`global_places`; none: no choice, :attr:`global_fragments` stays 0); then the ranks gather at
    the waited half's last step too (:meth:`decide_globals`). ``through_racks``: a waited global average takes
    the route through the racks (the PyTorch adapter's), else it is the ring over every rank (the Keras adapter's).

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
                 through_racks=True):
        self.period = max(1, int(period))
        self.first = int(start) + self.period  # one period of set-up (a process set's first op) untimed
        self.cycle = max(1, int(cycle))
        self.blocks = self.cycle * replicates(periods, self.cycle)  # averaging periods timed each way
        self.length = self.period * self.blocks
        self.look = self.first + self.length + self.period * self.cycle - 1  # after the first overlapped cycle
        self.min_gain = float(min_gain)
        self.decided = None  # True / False once decided
        self.gain = math.nan
        self.early = False  # decided at the first look
        self._seconds = np.zeros(2 * self.blocks)  # each period's seconds: waited ones, then overlapped ones
        self.globals_at = tuple(int(k) for k in globals_at)
        self.world_size = int(world_size)  # the ranks a global average's ring runs over
        self.through_racks = bool(through_racks)
        self.global_fragments = 0  # the global averages in flight, in this many fragments (0: the route)
        self._local = np.zeros(self.blocks)  # the waited periods' seconds of local steps (no average)
        self.route_cost = self.local_step = math.nan  # what decide_globals weighed
        self._last_end = None  # when the step before ended (step_ended)
        self._folds = np.zeros(2)  # the overlapped half's averages in flight but the global ones: steps, how many
        self.staleness = math.nan  # after how many steps those were folded in (decide: staleness), where told

    @classmethod
    def of(cls, plan, choose_globals=False, through_racks=True):
        """The trial of an optimizer's :class:`hvd_dssync.plan.SyncPlan` (or of anything with its ``policy``,
        ``schedule`` and ``action``, as both adapters' optimizers have): after its warm-up, one period per
        average, whole cycles of its averages' kinds (:func:`averages_cycle`). ``choose_globals``: the global
        averages may go either way (:meth:`decide_globals`), waited (``through_racks`` or not) or in flight."""
        policy = plan.policy
        trial = cls(policy.warmup_steps, policy.average_every,
                    averages_cycle(plan.schedule.cycle, policy.average_every, policy.global_every),
                    world_size=plan.schedule.world_size, through_racks=through_racks)
        if choose_globals:
            trial.globals_at = global_places(plan, trial.first, trial.period, trial.blocks)
        return trial

    @property
    def _globals_step(self):
        """The waited half's last step, where the ranks decide the global averages' way (None: no choice)."""
        return self.first + self.length - 1 if self.globals_at else None

    @property
    def last(self):
        """The trial's last step, where it decides."""
        return self.first + 2 * self.length - 1

    def overlap_at(self, step):
        """Whether ``step``'s average is overlapped."""
        if self.decided is not None:
            return self.decided
        return step >= self.first + self.length

    def note(self, step, seconds, local=False):
        """A step's seconds, from the end of the step before to the end of this one; ``local``: a step with no
        average (counted apart in the waited half, for :meth:`decide_globals`)."""
        if self.decided is None and self.first <= step <= self.last and math.isfinite(seconds):
            block = (step - self.first) // self.period
            self._seconds[block] += float(seconds)
            if local and block < self.blocks:
                self._local[block] += float(seconds)

    def note_fold(self, step, kind, started):
        """An average in flight of ``kind``, started at step ``started``, was folded in at ``step``: in the
        overlapped half, what :meth:`decide` weighs the other averages' saving against (:func:`staleness`). A global
        average's fragments are folded in a step after they started (:func:`folds_now`): not counted."""
        from .policy import GLOBAL
        if self.decided is None and kind != GLOBAL and self.first + self.length <= started <= self.last:
            self._folds += (step - started, 1)

    def due(self, step):
        """Whether the ranks gather their figures after ``step`` and decide (:meth:`figures`, then
        :meth:`decide`; at :attr:`look`, early)."""
        return self.decided is None and step in (self.look, self.last, self._globals_step)

    def step_ended(self, step, gather, local=False, warm=None, folded=None):
        """What an adapter calls at the end of each step (``local``: one with no average; ``folded``: the kind and
        start step of an average in flight this step folded in, :meth:`note_fold`): notes the step's
        seconds, from the end of the step before; where :meth:`due`, decides from ``gather(figures)``, the
        adapter's allgather of :meth:`figures` over the optimizer's ranks (a collective, at the same step on
        every rank): the global averages' way at the waited half's last step, overlap at the look and the last
        step. Where :meth:`warms` says, ``warm(fragments)`` (the adapter's op on the way's sets, every rank at
        the same step), untimed. Returns the decision on overlap taken at this step, or None."""
        now = time.perf_counter()
        if self._last_end is not None:
            self.note(step, now - self._last_end, local)
        if folded is not None:
            self.note_fold(step, *folded)
        decided = None
        if self.due(step):
            gathered = gather(self.figures())
            if step == self._globals_step:
                self.decide_globals(gathered)
            else:
                decided = self.decide(gathered, early=step < self.last)
        way = self.warms(step)
        if warm is not None and way is not None:
            warm(way)
        self._last_end = time.perf_counter()
        return decided

    def warms(self, step):
        """The way of the global averages whose sets the adapter warms at the end of ``step``, untimed, or None: the
        route (0) before the period of the waited half's first global average, the fragments (their count) before
        the overlapped half's, where the trial chose them. One op of what the way sends across the racks, of zeros:
        on the accelerator bench the first global average of each way cost its step 0.3-0.7 s more than the next
        (the first route 1.0-1.4 s against 0.9 s; the first fragment's fold 0.5-0.9 s against 0.2 s), which the
        trial, with two global averages each way, took for what the way costs.

        Example::

            >>> trial = OverlapTrial(start=0, period=8, cycle=4, globals_at=(2, 6), world_size=4)
            >>> trial.global_fragments = 6
            >>> [(s, trial.warms(s)) for s in range(120) if trial.warms(s) is not None]
            [(23, 0), (87, 6)]
        """
        if not self.globals_at or self.decided is not None:
            return None
        before = self.first + self.globals_at[0] * self.period - 1
        if step == before:
            return 0
        if step == before + self.length and self.global_fragments:
            return self.global_fragments
        return None

    def figures(self):
        """This rank's seconds of each averaging period of the trial, the waited ones first, where the trial
        chooses the global averages' way the waited periods' seconds of local steps, then the overlapped half's
        folds (:meth:`note_fold`: steps summed, how many): one row."""
        row = np.concatenate([self._seconds, self._local] if self.globals_at else [self._seconds])
        return np.concatenate([row, self._folds]).reshape(1, -1)

    def _folds_of(self, gathered):
        """The ranks' folds (:meth:`figures`' last two columns), none where the rows hold the periods alone."""
        rows = np.asarray(gathered, dtype=float)
        width = (3 if self.globals_at else 2) * self.blocks
        return rows[:, width:width + 2] if rows.shape[1] >= width + 2 else np.zeros((0, 2))

    def decide_globals(self, gathered):
        """From every rank's :meth:`figures` at the end of the waited half: how many fragments the global averages
        go in, over every rank at once, behind the steps, in the overlapped half and after it where overlap stays
        (:func:`~hvd_dssync.fragments.global_fragments`), or 0: waited for (through the racks, or where the adapter
        has no route, over every rank). What a global average cost is its waited period's seconds less the mean
        of the other periods (the racks' averages), over the ranks and the periods that hold one; what could hide
        each fragment, the ``GLOBAL_FOLD_STEPS`` local steps before its fold (:func:`folds_now`), the mean
        local step over the ranks and the periods without one. NaN (nothing timed) keeps them waited.

        Example::

            >>> trial = OverlapTrial(start=0, period=8, cycle=4, globals_at=(2, 6), world_size=4)
            >>> waited = [1.3, 1.2, 2.0, 1.2, 1.2, 1.3, 1.8, 1.2]   # each period: 7 local steps of 0.13 s, an average
            >>> trial.decide_globals([waited + [0.0] * 8 + [0.91] * 8]), round(trial.route_cost, 2)
            (8, 0.67)
            >>> fast_link = [1.2, 1.21, 1.23, 1.19, 1.2, 1.21, 1.25, 1.2]   # a global average 0.04 s longer
            >>> trial.decide_globals([fast_link + [0.0] * 8 + [0.91] * 8]), round(trial.local_step, 2)
            (1, 0.13)
        """
        rows = np.asarray(gathered, dtype=float)[:, :3 * self.blocks].reshape(-1, 3, self.blocks)
        waited, local = rows[:, 0, :].mean(axis=0), rows[:, 2, :].mean(axis=0)
        at = np.zeros(self.blocks, dtype=bool)
        at[list(self.globals_at)] = True
        self.route_cost = waited[at].mean() - waited[~at].mean() if (~at).any() else math.nan
        local_steps = self.period - 1  # a period's steps less its averaging step
        self.local_step = local[~at].mean() / local_steps if (~at).any() and local_steps else math.nan
        self.global_fragments = global_fragments(self.route_cost, self.local_step, self.world_size, self.period,
                                                 self.through_racks)
        return self.global_fragments

    @property
    def globals_in_flight(self):
        """Whether the trial chose the global averages in flight (:attr:`global_fragments`)."""
        return self.global_fragments > 0

    def _kinds(self):
        """The places of the cycle whose savings decide each kind of average: the global averages in flight (their
        place and the next, which holds their fragments' folds) where the trial sent them so, then the others
        (the racks' averages, the bridges); else every place, one kind."""
        if not self.global_fragments:
            return (), tuple(range(self.cycle))
        places = {k % self.cycle for k in self.globals_at}
        places |= {(k + 1) % self.cycle for k in places}
        return tuple(sorted(places)), tuple(k for k in range(self.cycle) if k not in places)

    def decide(self, gathered, early=False):
        """From every rank's :meth:`figures` (rows): keep overlap where it shortened the ranks' mean step by
        ``min_gain`` or more, and by more than the noise; each kind of average on its own where the global
        averages went in flight (:meth:`_kinds`): the others only where their places saved ``min_gain`` times the
        share of a period after which they were folded in (:func:`staleness`: all of it where none was), the global
        averages in flight only where theirs saved ``min_gain`` times ``GLOBAL_FOLD_STEPS`` over the period (the
        share the staleness they are folded in with asks for: a step's, not a period's), by the mean alone. The
        route and the fragments are both exact (the fragments kept parity with Horovod's optimizer on every task,
        docs/tuning.md), so a wrong choice costs time alone, as much as the two ways differ: the mean, which the
        waited half's choice agreed with, is the better bet; and no margin of standard errors is within reach of
        two global averages each way (on the accelerator bench the route's own spread left a standard error of
        0.2-0.36 s against savings of 0.25-0.6 s a global average). The saving of each averaging period is the
        waited period's seconds less the overlapped one's at the same place in the schedule's cycle, averaged
        over the ranks (what the ranks' noise shares, as where they wait for each other, stays in it; what is
        their own averages out). Its noise is read from the periods of the same place (a rack's average against
        a rack's, a bridge against a bridge): the kinds of a cycle save differently (a bridge hides far more
        than a rack's average), which is no noise. The others are kept where what their places saved a cycle,
        less :data:`MIN_T` standard errors, is still their share of their waited periods. Returns the decision
        on the averages but the global ones (None where the first look lets the trial go on);
        :attr:`global_fragments` is 0 where the global ones go back to the route.

        ``early``: the first look, at :attr:`look`, with one overlapped cycle timed: off where no kind's places
        saved their share of their waited periods in that cycle (the final rule could then keep overlap only where
        the second cycle saved far more than the first; unsure is off); else None, the trial goes on.
        """
        periods = np.asarray(gathered, dtype=float)[:, :2 * self.blocks].reshape(-1, 2, self.blocks)
        waited, overlapped = periods[:, 0, :], periods[:, 1, :]
        global_places, others = self._kinds()
        # The share of their waited periods each kind must save: a global average's fragments are folded in a step
        # after they start, not a period: so much less staleness to pay for.
        fragments_gain = self.min_gain * GLOBAL_FOLD_STEPS / self.period
        # The others are folded in once done: on a host whose cores are free, a step or two after they start.
        folds = self._folds_of(gathered)
        stale = staleness(folds, self.period)
        self.staleness = stale if folds[:, 1].sum() > 0 else math.nan
        others_gain = self.min_gain * stale / self.period
        kinds = [(list(places), gain) for places, gain in ((global_places, fragments_gain), (others, others_gain))
                 if places]
        by_place = waited.mean(axis=0).reshape(-1, self.cycle).mean(axis=0)  # a waited period's seconds, each place
        if early:
            # The first overlapped cycle holds each place once, set against the waited periods of the same place.
            first = by_place - overlapped[:, :self.cycle].mean(axis=0)
            if any(first[places].sum() >= gain * by_place[places].sum() for places, gain in kinds):
                return None
            self.gain = _shorter(overlapped[:, :self.cycle], waited)
            self.decided, self.early, self.global_fragments = False, True, 0
            return False
        self.gain = _shorter(overlapped, waited)
        saved = (waited - overlapped).mean(axis=0).reshape(-1, self.cycle)  # a row per cycle, a column per place
        freedom = saved.size - self.cycle
        variance = ((saved - saved.mean(axis=0)) ** 2).sum() / freedom if freedom > 0 else math.inf

        def saves(places, gain, errors):
            # A gain of ``gain`` of the places' waited periods: what they saved a cycle, less ``errors`` standard
            # errors.
            if not places or not math.isfinite(self.gain):
                return False
            places = list(places)
            error = math.sqrt(len(places) * variance / saved.shape[0])
            return saved[:, places].sum(axis=1).mean() - errors * error >= gain * by_place[places].sum()

        if global_places and not saves(global_places, fragments_gain, 0.0):
            self.global_fragments = 0
        self.decided = bool(saves(others, others_gain, MIN_T))
        return self.decided

    @property
    def overlapping(self):
        """Whether any average runs in flight after the trial (the global ones' fragments included); None during
        it."""
        return None if self.decided is None else bool(self.decided or self.global_fragments)

    def fragments_at(self, step):
        """In how many fragments ``step``'s global average, if it has one, goes in flight (:meth:`decide_globals`,
        :meth:`decide`): none in the waited half and before it; 0: through the racks."""
        return self.global_fragments if self.decided is not None or step >= self.first + self.length else 0

    def rule_out(self):
        """Overlap cannot run here (sparse averaging in use, which every rank agreed on): off, no trial."""
        self.decided = False

    def describe(self):
        if self.decided is None:
            return "overlap: on trial"
        if math.isnan(self.gain):
            return f"overlap {'on' if self.overlapping else 'off'} (no trial)"
        cycle = ", its first overlapped cycle" if self.early else ""
        way = ""
        if math.isfinite(self.route_cost):
            flight = "over every rank, in flight" + (f", in {self.global_fragments} fragments"
                                                     if self.global_fragments > 1 else "")
            waited, cost = ("through the racks", "the route") if self.through_racks else ("waited", "one waited")
            way = (f"; global averages {flight if self.globals_in_flight else waited}"
                   f": {cost} cost {self.route_cost:.3g} s, a local step {self.local_step:.3g} s")
        kinds = ""
        if self.decided != self.overlapping:
            kinds = ", the global averages' fragments only"
        change = f"{self.gain:.0%} shorter" if self.gain >= 0 else f"{-self.gain:.0%} longer"
        stale = (f"; the others folded in {self.staleness:.2g} step{'' if self.staleness == 1 else 's'} late"
                 if math.isfinite(self.staleness) else "")
        return (f"overlap {'on' if self.overlapping else 'off'}{kinds} "
                f"(the overlapped steps {change}{cycle}{way}{stale})")
