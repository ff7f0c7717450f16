"""One rank's adaptive policy at run time: :class:`AdaptiveState`, the windows, the probes, the early checks."""
import logging
import math

import numpy as np

from ..policy import BSP, GLOBAL, GROUP, LOCAL
from .decisions import FIGURES, Decision, decide, initial_decision

__all__ = ["AdaptiveState"]

logger = logging.getLogger("hvd_dssync.adaptive")


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

        >>> from hvd_dssync.adaptive import AdaptivePolicy
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

            >>> from hvd_dssync.adaptive import AdaptivePolicy
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
