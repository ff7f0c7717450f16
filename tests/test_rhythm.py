"""The racks' period where their averages hide (hvd_dssync.rhythm), and the policy that follows it
(hvd_dssync.policy.Policy.with_period): the rule on recorded figures and on generated noisy ones, the probe that
starts the default's trial at half the period."""
import itertools

import numpy as np
import pytest

from hvd_dssync.config import quickens_racks
from hvd_dssync.overlap import OverlapTrial
from hvd_dssync.plan import SyncPlan
from hvd_dssync.policy import GLOBAL, GROUP, LOCAL, Policy
from hvd_dssync.rhythm import HIDING_PERIODS, hides_maybe, quickened_every

# The steps after which the default's trial folded the racks' averages in, as each bench job logged it (every rank's
# largest mean; 4 emulated hosts of one rank, 2 racks, unless said): the accelerator's 100 ms of compute a step, the
# same at 50 ms, the static headline (5 ms steps), 8 ranks on the 2 cores.
ACCELERATOR = [1.4, 1.5, 1.4, 2.6, 2.0, 1.4, 2.0, 1.5, 2.0, 2.0, 1.8, 1.8, 1.8, 1.2, 1.2, 1.5, 1.3, 1.5]
AT_50_MS = [2.0, 2.4, 2.2]
STATIC = [5.7, 5.7, 5.8, 8.0, 5.7, 8.0, 5.7, 5.7, 5.7, 3.7, 8.0, 3.7, 5.7, 3.7, 5.7, 3.7]
EIGHT_RANKS = [3.6, 3.2, 3.4, 3.8]


def _rows(stale, ranks=4, folds=6):
    return [[stale * folds, folds]] * ranks


def test_the_racks_average_twice_as_often_where_the_recorded_trials_saw_them_hide():
    """On the accelerator the racks' averages were folded in within 2 steps of 8 in 17 jobs of 18: the period halves
    there; never on the static headline nor with 8 ranks on 2 cores, where they took 3.2 steps or more."""
    assert sum(quickened_every(_rows(stale), 8) == 4 for stale in ACCELERATOR) == 17
    assert sum(quickened_every(_rows(stale), 8) == 4 for stale in AT_50_MS) == 1
    assert all(quickened_every(_rows(stale, ranks), 8) is None for stale, ranks in
               itertools.chain(zip(STATIC, itertools.repeat(4)), zip(EIGHT_RANKS, itertools.repeat(8))))


def test_the_rule_is_unsure_without_two_folds_on_every_rank():
    assert quickened_every([[1.0, 1.0]] + [[6.0, 6.0]] * 3, 8) is None  # one rank told one fold
    assert quickened_every(np.zeros((4, 2)), 8) is None and quickened_every(np.zeros((0, 2)), 8) is None
    assert quickened_every(_rows(1.0), 3) is None and quickened_every(_rows(1.0), 2) is None  # odd; too short


@pytest.mark.parametrize("weights, ranks, quickened_at_least, quickened_at_most", [
    ((0.6, 0.3, 0.1, 0, 0, 0, 0, 0), 4, 0.85, 1.0),    # the accelerator: most folds a step after they start
    ((0.2, 0.4, 0.3, 0.1, 0, 0, 0, 0), 4, 0.0, 0.35),  # a mean of 2.3 steps: mostly kept
    ((0, 0, 0.3, 0.4, 0.3, 0, 0, 0), 8, 0.0, 0.0),     # 8 ranks on 2 cores: 3-5 steps
    ((0, 0, 0, 0, 0.3, 0.4, 0.2, 0.1), 4, 0.0, 0.0)])  # the static headline: 5-8 steps
def test_the_racks_period_under_noise(weights, ranks, quickened_at_least, quickened_at_most):
    """Generated trials (200 each): each rank's 6 folds of the overlapped half each 1-8 steps after they started,
    drawn at ``weights``; the period halves where every rank's mean is 2 steps or less."""
    rng = np.random.default_rng(len(weights) * ranks + int(10 * weights[0]))
    quickened = 0
    for _ in range(200):
        steps = rng.choice(np.arange(1, 9), size=(ranks, 6), p=weights)
        quickened += quickened_every(np.stack([steps.sum(axis=1), np.full(ranks, 6)], axis=1), 8) == 4
    assert quickened_at_least * 200 <= quickened <= quickened_at_most * 200, quickened


def test_the_trial_quickens_only_a_period_the_default_chose():
    """A trial whose racks saved nothing in flight keeps them waited; where it may quicken and they were folded in
    a step and a half late, they go in flight twice as often, and it says so."""
    waited = [1.0] * 8
    rows = [waited + waited + [9.0, 6.0]] * 4
    kept, quickened = OverlapTrial(0, 8, cycle=4), OverlapTrial(0, 8, cycle=4)
    quickened.quickens = True
    assert kept.decide(rows) is False and kept.racks_every is None
    assert quickened.decide(rows) is True and quickened.racks_every == 4
    assert quickened.describe().endswith("the others folded in 1.5 steps late: the racks every 4 steps from the "
                                         "next period)")
    early, saving = OverlapTrial(0, 8, cycle=4), OverlapTrial(0, 8, cycle=4)
    early.quickens = True
    assert early.decide(rows, early=True) is True and early.early and early.racks_every == 4
    # Where the first overlapped cycle saved enough, the trial goes on, unless the racks hid: it ends at its look.
    faster = [waited + [0.8] * 8 + [9.0, 6.0]] * 4
    assert saving.decide(faster, early=True) is None
    saving.quickens = True
    assert saving.decide(faster, early=True) is True and saving.early and saving.racks_every == 4


def test_only_the_period_the_default_picked_on_racks_may_quicken():
    assert quickens_racks(None, None, "topology") and not quickens_racks(8, None, "topology")
    assert not quickens_racks(None, None, "shuffle") and not quickens_racks(None, None, "topology", "adaptive")


@pytest.mark.parametrize("warmup, every, global_every, new, at", itertools.product(
    (0, 1, 3), (4, 8), (0, 8, 12, 32), (1, 2, 4), (0, 5, 40)))
def test_a_quickened_policy_goes_on_where_a_cycle_starts(warmup, every, global_every, new, at):
    """The old rhythm up to the first start of one of its periods from ``at`` on (after ``at`` where the step before
    was a global average, which sized its fragments by the old rhythm); from there, the new period's pattern, the global averages where they were, and the schedule's groups in their
    order (one schedule step a group average, none skipped); its configuration is the one it was built with; and
    back to the old period as far on, the same."""
    if every % new:
        return
    before = Policy(warmup, global_every, every)
    policy = before.with_period(at, new)
    start = policy.since[0]
    assert (start - warmup) % every == 0 and max(at, warmup) <= start < max(at + 1, warmup) + every
    assert start > at or at <= warmup or new == every or before.action(at - 1) != GLOBAL  # its fragments
    assert [policy.action(t) for t in range(start)] == [before.action(t) for t in range(start)]
    fresh = Policy(warmup, global_every, new)
    span = every if new < every and global_every > every and global_every % every == 0 else 0

    def spanned(t):  # a group average within the period built after a global average's start: none
        return 0 < (t - warmup + 1) % (global_every or 1) < span

    assert [policy.action(t) for t in range(start, start + 96)] == [
        LOCAL if spanned(t) else fresh.action(t) for t in range(start, start + 96)]
    assert all(policy.steps_to_next_average(t) == every for t in range(start, start + 96)
               if span and policy.action(t) == GLOBAL)
    # The Keras adapter's table of branches repeats every period(): the kinds do, and the schedule advances alike.
    period = policy.period()
    assert all(policy.action(t) == policy.action(t + period) for t in range(start, start + 96))
    advance = {policy.schedule_step(t + period) - policy.schedule_step(t) for t in range(start, start + 96)}
    assert len(advance) == 1, advance
    scheduled = [policy.schedule_step(t) for t in range(start + 96) if policy.action(t) == GROUP]
    assert scheduled == list(range(scheduled[0], scheduled[0] + len(scheduled)))
    assert policy.config() == before.config()
    assert all(policy.action(t + policy.steps_to_next_average(t)) != "local" for t in range(start, start + 40))
    back = policy.with_period(start + 40, every)
    again = back.since[0]
    assert (again - warmup) % every == 0 and start + 40 <= again < start + 40 + every
    assert [back.action(t) for t in range(again, again + 96)] == [before.action(t) for t in range(again, again + 96)]
    scheduled = [back.schedule_step(t) for t in range(again + 96) if back.action(t) == GROUP]
    assert scheduled == list(range(scheduled[0], scheduled[0] + len(scheduled))) and back.config() == before.config()


def test_a_policy_takes_a_divisor_or_a_multiple_of_its_period():
    with pytest.raises(ValueError, match="must divide the policy's 8, or be a multiple of it"):
        Policy(0, 32, 8).with_period(0, 3)
    assert Policy(0, 32, 8).with_period(0, 4).since[0] == 0 and Policy(2, 32, 8).with_period(0, 4).since[0] == 2


def test_a_plan_quickens_the_racks_and_keeps_the_global_averages():
    plan = SyncPlan(rank=1, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]], average_every=8,
                    global_every=32, schedule_options={"intra_steps": None})  # the default's: no bridges
    kinds = [plan.action(t).kind for t in range(64)]
    start = plan.change_period(10, 4)
    assert start == 16 and [plan.action(t).kind for t in range(16)] == kinds[:16]
    # After each global average, the period built (its fragments span it: Policy.global_span).
    assert [t for t in range(16, 72) if plan.action(t).kind == GROUP] == [19, 23, 27, 39, 43, 47, 51, 55, 59, 71]
    assert [t for t in range(96) if plan.action(t).kind == GLOBAL] == [31, 63, 95]
    assert plan.policy.steps_to_next_average(31) == 8 and plan.policy.steps_to_next_average(39) == 4
    assert plan.action(39).group == (0, 1) and plan.config()["policy"]["average_every"] == 8


def _trial_of_the_default(warmup=0):
    plan = SyncPlan(rank=0, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]], average_every=8,
                    global_every=32, warmup_steps=warmup, schedule_options={"intra_steps": None})
    trial = OverlapTrial.of(plan, choose_globals=True, quickens=True)
    trial.plan = plan  # for the tests' own use
    return trial


def test_the_default_probes_whether_the_racks_hide_before_its_trial():
    """Where DS-Sync chose the racks' period, the trial asks for half of it after a waited period, where the probe of
    the global averages' way at its end says they may hide: two periods with the racks' averages in flight, the
    ranks deciding at the last step; the trial of both ways after it, a period of set-up on."""
    trial = _trial_of_the_default(warmup=3)
    assert trial.average_every == 8 and trial.decide_globals([[0.09, 0.13]] * 4) == 8 and trial.average_every == 4
    assert (trial.hiding.first, trial.hiding.step) == (11, 3 + HIDING_PERIODS * 8 - 1)
    assert trial._probe_step == 10 and trial.first == 3 + HIDING_PERIODS * 8 + 8
    assert [trial.overlap_at(s) for s in (10, 11, 26, 27, 34, trial.first + trial.length)] == [
        False, True, True, False, False, True]
    assert trial.due(26) and not trial.due(27)


def test_where_a_ring_takes_more_than_two_local_steps_the_probe_is_called_off():
    """The static headline's figures (a ring of an eighth of the model 0.06 s, a local step 0.01 s): no probe of the
    racks' period, the trial where it would be without one (its halves from the second period on, the global
    averages at their places there)."""
    trial, plain = _trial_of_the_default(), OverlapTrial.of(_trial_of_the_default().plan, choose_globals=True)
    assert trial.decide_globals([[0.06, 0.01]] * 4) == 0 and trial.hiding is None and trial.average_every == 8
    assert (trial.first, trial.look, trial.last, trial.globals_at) == (plain.first, plain.look, plain.last,
                                                                     plain.globals_at) == (8, 103, 135, (2, 6))
    assert hides_maybe(0.13, 0.065) and not hides_maybe(0.131, 0.065) and not hides_maybe(float("nan"), 0.1)


def _run(trial, folded_after, last):
    """Step ``trial`` to ``last``, its racks' averages at period 4 folded in ``folded_after`` steps after they start,
    every rank alike (4 ranks); returns what each step decided."""
    gather = lambda figures: np.repeat(np.asarray(figures, dtype=float), 4, axis=0)  # noqa: E731
    decisions = {}
    for step in range(last + 1):
        started = step - folded_after
        folded = ("group", started) if started >= 0 and (started + 1) % 4 == 0 and (started + 1) % 32 else None
        decisions[step] = trial.step_ended(step, gather, local=(step + 1) % 4 != 0, folded=folded,
                                           probe=lambda fragments: 0.0)  # a ring no slower than a local step
    return decisions


def test_where_the_racks_hide_the_trial_ends_after_the_probe():
    trial = _trial_of_the_default()
    decisions = _run(trial, folded_after=1, last=40)
    assert decisions[23] is True and [s for s, d in decisions.items() if d is not None] == [23]
    assert trial.overlap_at(24) and trial.average_every == 4 and trial.racks_every == 4 and trial.overlapping
    assert trial.describe().startswith("overlap on (the racks' averages hid in flight; global averages ")
    assert trial.describe().endswith("the others folded in 1 step late: the racks every 4 steps from step 8)")


def test_where_they_do_not_the_period_comes_back_and_the_trial_runs():
    trial = _trial_of_the_default()
    decisions = _run(trial, folded_after=3, last=trial.last)
    assert decisions[23] is None and trial.average_every == 8 and trial.hiding.racks_every is None
    assert decisions[trial.look] is not None or decisions[trial.last] is not None


def test_a_probe_missed_leaves_the_period_as_built():
    """A job resumed past the probe (its step taken from a checkpoint) never decides there: the period as built."""
    trial = _trial_of_the_default()
    trial.step_ended(500, lambda figures: figures)
    assert trial.average_every == 8 and trial.decided is None
