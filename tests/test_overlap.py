"""The default's trial of overlap (hvd_dssync.overlap): the rule alone, on generated noisy step times."""
import math

import numpy as np
import pytest

from hvd_dssync.fragments import FRAGMENTS_ENV, GLOBAL_FOLD_STEPS, forced_fragments, fragment_ranges, global_fragments
from hvd_dssync.overlap import MIN_GAIN, OverlapTrial, folds_now, runs_trial, staleness


def run_trials(trials, seconds):
    """Run every rank's trial as the adapters do (``step_ended``: the figures gathered at the first look and at
    the last step), each step's time ``seconds(step, overlapped)``; every rank's decision (they must agree,
    and be taken where the trial says: at its first look or at its last step)."""
    for step in range(trials[0].last + 1):
        for trial in trials:
            trial.note(step, seconds(step, trial.overlap_at(step)))
        due = [t.due(step) for t in trials]
        assert len(set(due)) == 1 and due[0] is (step in (trials[0].look, trials[0].last) and trials[0].decided is None)
        if due[0]:
            gathered = np.concatenate([t.figures() for t in trials])
            decisions = {t.decide(gathered, early=step < t.last) for t in trials}
            assert len(decisions) == 1 and (decisions != {None} or step == trials[0].look), (step, decisions)
    return [t.decided for t in trials]


def trial_of_ranks(rng, trials, compute, average, hidden, noise):
    """Run the ranks' ``trials``, whose steps take ``compute`` seconds each (times a log-normal factor of sigma
    ``noise``) plus, at each averaging step, ``average`` seconds waited for, or ``(1 - hidden)`` of it
    overlapped; every rank's decision."""
    period = trials[0].period

    def seconds(step, overlapped):
        time = compute * rng.lognormal(0.0, noise)
        if (step + 1) % period == 0:
            time += average * (1.0 - hidden if overlapped else 1.0) * rng.lognormal(0.0, noise)
        return time

    return run_trials(trials, seconds)


def trial_of(rng, ranks, compute, average, hidden, noise, period=4, cycle=4):
    """One trial on ``ranks`` ranks (:func:`trial_of_ranks`)."""
    return trial_of_ranks(rng, [OverlapTrial(0, period, cycle) for _ in range(ranks)], compute, average, hidden, noise)


@pytest.mark.parametrize("compute, average, hidden, expected", [
    (0.18, 0.36, 0.8, True),   # the accelerator scenario: a long average every 4 steps, mostly hidden
    (0.10, 0.10, 0.9, True),   # an average as long as a step, hidden
    (0.05, 0.20, 0.0, False),  # nothing hidden: the cores are busy (the CPU-bound emulated cluster)
    (0.05, 0.20, -0.2, False),  # overlapped averages cost more: they compete with the compute
    (0.20, 0.01, 0.9, False),  # too little to hide to tell
])
@pytest.mark.parametrize("noise", [0.1, 0.3])
def test_the_trial_keeps_overlap_where_it_shortens_the_steps_under_noise(compute, average, hidden, expected, noise):
    """8 ranks, step times noisy by a log-normal factor: the same decision on every rank, and the right one
    in at least 95 of 100 trials (off where the gain is under MIN_GAIN: the safe choice)."""
    rng = np.random.default_rng(int(compute * 1000 + average * 100 + noise * 10))
    right = 0
    for _ in range(100):
        decisions = trial_of(rng, 8, compute, average, hidden, noise)
        assert len(set(decisions)) == 1, decisions
        right += decisions[0] is expected
    assert right >= 95, right


def test_a_trial_times_whole_cycles_of_the_schedule_each_way():
    trial = OverlapTrial(start=2, period=4, cycle=4)
    assert (trial.first, trial.length, trial.last) == (6, 32, 69)  # each place of the cycle twice each way
    assert [trial.overlap_at(s) for s in (5, 6, 37, 38, 69)] == [False, False, False, True, True]
    assert trial.describe() == "overlap: on trial"
    trial.note(3, 9.0)  # before the trial: not counted
    for step in range(6, 70):
        trial.note(step, 0.3 if step < 38 else 0.24)
    assert np.allclose(trial.figures(), [[1.2] * 8 + [0.96] * 8 + [0.0, 0.0]])  # no average folded in: no folds
    mine = trial.figures()[:, :16]
    noisy = mine + np.tile([0.01, -0.01, 0.02, 0.0], 4)
    assert trial.decide(np.concatenate([mine, noisy])) is True and trial.overlap_at(100) is True
    assert trial.describe() == "overlap on (the overlapped steps 20% shorter)"
    assert not trial.due(69)  # decided once
    # Shorter, but under MIN_GAIN; then shorter by 20% on average but within its noise: off both times.
    assert OverlapTrial(0, 1).decide([[0.2, 0.21, 0.2, 0.19] + [0.2 * (1 - MIN_GAIN / 2)] * 4]) is False
    assert OverlapTrial(0, 1).decide([[0.2, 0.2, 0.2, 0.2, 0.1, 0.3, 0.05, 0.19]]) is False
    longer = OverlapTrial(0, 1)
    assert longer.decide([[0.2] * 4 + [0.22] * 4]) is False
    assert longer.describe() == "overlap off (the overlapped steps 10% longer)"  # not "-10% shorter"


def test_a_bridge_that_saves_more_than_the_racks_averages_is_no_noise():
    """Recorded on a host with a core per rank (16 cores, 8 ranks, the accelerator scenario, 2026-11-28):
    local steps of 0.13 s, a rack's average about 0.07 s, the exact bridge across the racks about 0.8 s, of
    which overlap hides all but about 0.3 s. The first rule paired the periods by their place in the cycle
    but read the spread of the savings over the places (0.07 s three times, 0.5 s once) as noise, and kept
    overlap off in that job, where it made the mean step 15% shorter (0.154 s against 0.182) and reached 95%
    sooner (13.9 s against 16.0). The noise of a place is now read from that place's own repeats."""
    rack, bridge = 4 * 0.13 + 0.07, 4 * 0.13 + 0.8
    waited = [rack, rack, rack, bridge] * 2
    overlapped = [4 * 0.13] * 3 + [4 * 0.13 + 0.3]
    overlapped = overlapped * 2
    jitter = np.array([[0.004, -0.003, 0.002, 0.01, -0.002, 0.003, -0.004, -0.012] * 2,
                       [-0.002, 0.001, 0.003, -0.02, 0.004, -0.001, 0.0, 0.015] * 2])
    assert OverlapTrial(0, 4, cycle=4).decide(np.array([waited + overlapped] * 2) + jitter) is True
    # The same figures as the first rule read them: the mean saving under 2.5 standard errors of the places.
    saved = (np.array(waited) - np.array(overlapped))[:4]
    assert saved.mean() < 2.5 * saved.std(ddof=1) / 2


@pytest.mark.parametrize("rack_hidden, bridge_hidden, expected", [
    (1.0, 0.6, True),    # the recorded job: the racks' averages hidden, most of the bridge
    (0.0, 0.1, False),   # a little of the bridge hidden: under MIN_GAIN of the cycle
    (0.0, 0.0, False),   # nothing hidden: cores busy
    (-0.1, -0.1, False),  # overlapped averages cost more: they compete with the compute
])
@pytest.mark.parametrize("noise", [0.1, 0.3])
def test_a_cycle_of_rack_averages_and_a_bridge_under_noise(rack_hidden, bridge_hidden, expected, noise):
    """8 ranks, the topology-aware schedule's cycle (three rack averages of 0.07 s, a bridge of 0.8 s, after
    4 local steps of 0.13 s each), step times noisy by a log-normal factor: the same decision on every rank,
    the right one in 95 of 100 trials."""
    rng = np.random.default_rng(int(100 * rack_hidden + 10 * bridge_hidden + 1000 * noise) % 2 ** 16)
    period, compute = 4, 0.13

    def seconds(step, overlapped):
        time = compute * rng.lognormal(0.0, noise)
        if (step + 1) % period == 0:
            bridge = ((step + 1) // period) % 4 == 0
            cost, hidden = (0.8, bridge_hidden) if bridge else (0.07, rack_hidden)
            time += cost * (1.0 - hidden if overlapped else 1.0) * rng.lognormal(0.0, noise)
        return time

    right = 0
    for _ in range(100):
        decisions = set(run_trials([OverlapTrial(0, period, cycle=4) for _ in range(8)], seconds))
        assert len(decisions) == 1
        right += decisions.pop() is expected
    assert right >= 95, right


def test_ruled_out_or_not_run():
    trial = OverlapTrial(0, 4)
    trial.rule_out()
    assert trial.overlap_at(50) is False and trial.describe() == "overlap off (no trial)"
    assert runs_trial(None, False, False, 8, True)
    for arguments in ((False, False, False, 8, True), (True, False, False, 8, True), (None, True, False, 8, True),
                      (None, False, True, 8, True), (None, False, False, 1, True), (None, False, False, 8, False)):
        assert not runs_trial(*arguments), arguments


@pytest.mark.parametrize("saving, calls_at", [(0.5, "look, last"), (0.0, "look")])
def test_the_adapters_step_end_gathers_at_the_first_look_and_at_the_trials_last_step(saving, calls_at, monkeypatch):
    """``step_ended``, what both adapters call after every step: it times the steps itself, on the clock it reads
    (here a clock of the test's: a step waited for takes 10 ms, an overlapped one ``saving`` less, whatever else
    the host runs) and calls the adapter's allgather at the first look, after the first overlapped cycle, and
    again at the last step where the first look did not end the trial."""
    import types

    import hvd_dssync.overlap
    now = [0.0]
    monkeypatch.setattr(hvd_dssync.overlap, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    trial = OverlapTrial(start=0, period=1)
    calls, decisions = [], []

    def gather(figures):
        calls.append(step)
        return np.concatenate([figures, figures])  # two ranks alike

    for step in range(trial.last + 3):
        now[0] += 0.01 * (1.0 - saving if trial.overlap_at(step) else 1.0)
        decisions.append(trial.step_ended(step, gather))
    at = {"look": trial.look, "last": trial.last}
    assert calls == [at[name] for name in calls_at.split(", ")], calls
    decided = calls[-1]
    assert decisions[:decided] == [None] * decided and decisions[decided] is (saving > 0)
    assert decisions[decided + 1:] == [None] * (len(decisions) - decided - 1) and trial.decided is (saving > 0)
    assert trial.early is (calls_at == "look")
    # Every period timed (the untimed set-up period holds the first step).
    timed = trial.figures()[:, :2 * trial.blocks] > 0
    assert timed.all() if calls_at != "look" else timed[0, :trial.blocks + 1].all()


@pytest.mark.parametrize("average_every,global_every,options", [
    (8, 32, {"intra_steps": None, "global_via_bridges": True}), (8, 32, {}), (4, 16, {"intra_steps": 1}),
    (4, 0, {}), (2, 6, {"intra_steps": 2})])
def test_the_trials_cycle_holds_each_kind_of_average_at_the_same_places(average_every, global_every, options):
    """Each way of the trial is timed over whole cycles of the averages' kinds, global averages included, so
    that each overlapped period is set against a waited one of the same kind."""
    from hvd_dssync.overlap import averages_cycle
    from hvd_dssync.plan import SyncPlan
    plan = SyncPlan(0, 8, schedule="topology", topology=[[0, 1, 2, 3], [4, 5, 6, 7]], average_every=average_every,
                    global_every=global_every, schedule_options=options)
    kinds = []
    for step in range(2000):
        action = plan.action(step)
        if action.kind != "local":
            kinds.append((action.kind, plan.schedule.crosses(action.group) if action.kind == "group" else None))
    cycle = OverlapTrial.of(plan).cycle
    assert cycle == averages_cycle(plan.schedule.cycle, average_every, global_every)
    assert all(kinds[i] == kinds[i + cycle] for i in range(len(kinds) - cycle)), (cycle, kinds[:3 * cycle])


@pytest.mark.parametrize("hidden", [0.0, -0.2])
@pytest.mark.parametrize("noise", [0.1, 0.3])
def test_the_first_look_ends_a_trial_where_nothing_is_hidden(hidden, noise):
    """Where overlap hides nothing (cores busy, as on the CPU-bound emulated cluster), the first look after one
    overlapped cycle ends the trial in at least 90 of 100 trials (8 ranks, noisy step times): half the
    overlapped steps, each folding its average in a period late, spared."""
    rng = np.random.default_rng(int(10 * noise - 10 * hidden))
    early = 0
    for _ in range(100):
        ranks = [OverlapTrial(0, 4, 4) for _ in range(8)]
        assert trial_of_ranks(rng, ranks, 0.05, 0.20, hidden, noise) == [False] * 8
        early += ranks[0].early
    assert early >= 90, early


def decide_where_due(trials, step, probe=lambda rank: math.nan):
    """Where the ranks' ``trials`` are due after ``step``, each decides from every rank's figures, as the adapters
    do: the global averages' way after the set-up period from each rank's ``probe(rank)`` (its seconds of a
    period's fragment's ring), overlap at the first look and the last step."""
    first = trials[0]
    if first.due(step):
        if step == first.first - 1:
            gathered = np.concatenate([t.probe_figures(probe(rank)) for rank, t in enumerate(trials)])
            assert len({t.decide_globals(gathered) for t in trials}) == 1
            return
        gathered = np.concatenate([t.figures() for t in trials])
        assert len({t.decide(gathered, early=step < t.last) for t in trials}) == 1


def trial_choosing_globals(rng, ranks, compute, rack, route, noise, ring=1.3, hides=True):
    """A trial on ``ranks`` ranks of the accelerator's schedule (an average every 8 steps, a cycle of 4: three
    racks' averages, then a global one) that chooses the global averages' way: a step computes ``compute``
    seconds, a rack's average costs ``rack`` (nothing hidden overlapped: what the racks showed on the emulated
    cluster), a global one ``route`` through the racks, waited for, or in flight a ring of ``ring`` times that
    in the fragments the trial chose, each exposed past the local step before its fold (GLOBAL_FOLD_STEPS; all
    of it where the ring does not hide, ``hides`` False: it competes with the compute); the probe a ring of an
    eighth of that; each time noisy by a log-normal factor of sigma ``noise``. Every rank's choice of the globals'
    way (taken after the set-up period, alike: its fragments), the fragments kept once the trial decided (0: the
    route), and its decision on the other averages."""
    trials = [OverlapTrial(0, 8, cycle=4, globals_at=(2, 6), world_size=ranks) for _ in range(ranks)]
    first = trials[0]
    chose, chosen = first.first - 1, None  # the set-up period's last step
    for step in range(first.last + 1):
        averaging = (step + 1) % 8 == 0
        place = (step - first.first) // 8 % 4
        for trial in trials:
            seconds = compute * rng.lognormal(0.0, noise)
            fragments = trial.fragments_at(step)
            if averaging and place == 2 and step >= first.first:
                if fragments:
                    hidden = GLOBAL_FOLD_STEPS * compute if hides else 0.0
                    exposed = fragments * max(0.0, ring * route / fragments - hidden)
                    seconds += exposed * rng.lognormal(0.0, noise)
                else:
                    seconds += route * rng.lognormal(0.0, noise)
            elif averaging:
                seconds += rack * rng.lognormal(0.0, noise)
            trial.note(step, seconds, local=not averaging)
        due = {t.due(step) for t in trials}
        assert len(due) == 1 and due.pop() is ((step in (chose, first.look, first.last)) and first.decided is None)
        if first.due(step) and step != chose:
            assert first.figures().shape == (1, 2 * first.blocks + 2)  # the periods, then the folds
        decide_where_due(trials, step, lambda rank: ring * route / 8 * rng.lognormal(0.0, noise))
        if step == chose:
            chosen = first.global_fragments
    assert len({(t.global_fragments, t.decided) for t in trials}) == 1
    return chosen, first.global_fragments, first.decided


@pytest.mark.parametrize("compute, rack, route, ring, fragments, kept, hides", [
    # the accelerator at 4 ranks: a ring of the whole model would be waited for
    (0.128, 0.15, 0.70, 1.3, (6, 8), True, True),
    # the same where the rings compete with the compute, all of each exposed: 1.3x the route (within the noise of
    # the route's price, kept or not), then 2x
    (0.128, 0.15, 0.70, 1.3, (6, 8), None, False),
    (0.128, 0.15, 0.70, 2.0, (8, 8), False, False),
    # a fast slow link: one ring hides behind the step before its fold, 0.06 s of the global average's two periods
    # (2.3 s): a saving near the fragments' share of MIN_GAIN (0.6%), kept or not
    (0.128, 0.15, 0.06, 1.3, (1, 2), None, True),
    (0.05, 0.10, 0.02, 1.3, (1, 2), None, True),
    # the static CPU-bound cluster: not even a period's steps hide the ring
    (0.012, 0.06, 0.38, 1.3, (0, 0), False, True),
])
@pytest.mark.parametrize("ranks, noise", [(4, 0.1), (8, 0.1), (8, 0.3)])
def test_the_probe_chooses_the_global_averages_way_under_noise(compute, rack, route, ring, fragments, kept, hides,
                                                               ranks, noise):
    """The global averages go in flight in as many fragments as hide behind a step each (at most a period's):
    in at least 95 of 100 trials on noisy step times and probes, the route where expected, else in flight in as
    many fragments as expected (the fewest and the most of the noise's reach). Both halves then send them that
    way. The fragments are kept where they hide a global average's whole route (90 of 100 at least), not where
    they cost more than the route beyond the noise (the ring over every rank twice the route's time, each exposed:
    5 of 100 at most, 10 where each rank's every step is 30% off). The racks' averages, which hide nothing here (as
    on the emulated cluster), stay waited for (5 of 100 at most kept), whatever the fragments did."""
    rng = np.random.default_rng(int(compute * 1000 + route * 100 + ranks + 10 * noise + 10 * ring))
    trials = [trial_choosing_globals(rng, ranks, compute, rack, route, noise, ring, hides) for _ in range(100)]
    fewest, most = fragments
    assert sum(fewest <= chosen <= most for chosen, _, _ in trials) >= 95, trials
    if kept:
        assert sum(kept == chosen for chosen, kept, _ in trials) >= 90, trials
    elif kept is not None:
        assert sum(bool(kept) for _, kept, _ in trials) <= (10 if noise >= 0.3 else 5), trials
    assert sum(decided for _, _, decided in trials) <= 5, trials


@pytest.mark.parametrize("racks_hide", [0.0, 0.12])
def test_each_kind_of_average_is_kept_in_flight_on_its_own(racks_hide):
    """Where the global averages went in fragments, the fragments and the racks' averages are decided apart
    (100 trials, 4 ranks, noise 0.1): racks that cost more in flight than waited (the accelerator's 2 cores)
    stay waited for beside fragments that hide the route (5 of 100 kept at most); racks that hide 0.12 s of
    their 0.15 s, a tenth of their periods, are kept too (80 of 100 at least: 4 periods of the racks' places
    each way leave the noise 4 degrees of freedom, and unsure is off). Either way the trial says the averages
    run in flight (``overlapping``)."""
    rng = np.random.default_rng(7 + int(100 * racks_hide))
    kept, decided = 0, 0
    for _ in range(100):
        trials = [OverlapTrial(0, 8, cycle=4, globals_at=(2, 6), world_size=4) for _ in range(4)]
        first = trials[0]
        for step in range(first.last + 1):
            averaging = (step + 1) % 8 == 0
            place = (step - first.first) // 8 % 4
            for trial in trials:
                seconds = 0.128 * rng.lognormal(0.0, 0.1)
                flying = trial.overlap_at(step)
                if averaging and place == 2:
                    seconds += (0.02 if trial.fragments_at(step) else 0.70) * rng.lognormal(0.0, 0.1)
                elif averaging:
                    rack = (0.15 - racks_hide) if flying else 0.15
                    seconds += (rack + (0.08 if flying and not racks_hide else 0.0)) * rng.lognormal(0.0, 0.1)
                trial.note(step, seconds, local=not averaging)
            decide_where_due(trials, step, lambda rank: 0.12 * rng.lognormal(0.0, 0.1))  # a ring of 1.4 the route
        kept += first.global_fragments > 0
        decided += first.decided
        assert first.overlapping is (first.decided or first.global_fragments > 0)
    assert kept >= 90, kept
    assert (decided >= 80) if racks_hide else (decided <= 5), decided


# The probes of the default's trials (the medians over the ranks of a ring of a period's fragment of the model and of
# the set-up period's local steps), on `python -m hvd_dssync bench --scenarios accelerator --ranks 4 --contenders
# dssync-default` (two jobs, seed 0) and `--scenarios static` (8 ranks, seeds 0-2), 2026-12-04.
ACCELERATOR_4_RANKS = [(0.096, 0.149), (0.09, 0.135)]
STATIC_8_RANKS = [(0.054, 0.0199), (0.054, 0.00733), (0.067, 0.0135)]


@pytest.mark.parametrize("recorded, ranks, through_racks, fragments", [
    (ACCELERATOR_4_RANKS, 4, True, 8), (STATIC_8_RANKS, 8, True, 0),
    # Where the waited global average is the ring itself (the Keras adapter): the same on the accelerator; on the
    # static cluster 8 leave 0.27-0.43 s exposed, less than the ring's 0.43-0.54 s.
    (ACCELERATOR_4_RANKS, 4, False, 8), (STATIC_8_RANKS, 8, False, 8)])
def test_the_global_averages_way_on_recorded_probes(recorded, ranks, through_racks, fragments):
    """On the accelerator a ring of an eighth of the model took 0.09-0.1 s against a local step's 0.14-0.15 s: 6
    fragments would each be a ring within a step (a ring of the whole model in flight would be waited for most of
    its time at its fold, a step later); with room for a ring in flight to take twice as long, 8. On the static
    cluster 0.05-0.07 s against 7-20 ms: even 8 fragments would leave more exposed than the route's bridge costs:
    the route."""
    for probe, local in recorded:
        trial = OverlapTrial(0, 8, cycle=4, globals_at=(2, 6), world_size=ranks, through_racks=through_racks)
        assert trial.decide_globals([[probe, local]] * ranks) == fragments, (probe, local)
        assert trial.overlap_at(trial.first) is False and "global averages" not in trial.describe()


def test_unsure_keeps_the_route_and_no_choice_leaves_the_figures_as_they_were():
    """NaN figures (no probe, or no local step timed in the set-up period) keep the route; a trial that does not
    choose (no global places) gathers no local seconds and is not due after the set-up period."""
    trial = OverlapTrial(0, 8, cycle=4, globals_at=(2, 6))
    assert trial.probe_figures(0.1)[0, 1] != trial.probe_figures(0.1)[0, 1]  # no local step timed: NaN
    assert trial.decide_globals([[math.nan, 0.13], [0.1, 0.13]]) == 0 and trial.globals_in_flight is False
    assert trial.decide_globals([[0.1, math.nan]] * 2) == 0 and "global averages" not in trial.describe()
    plain = OverlapTrial(0, 8, cycle=4)
    assert plain.figures().shape == trial.figures().shape == (1, 18)
    assert trial.due(trial.first - 1) and not plain.due(plain.first - 1)


@pytest.mark.parametrize("options, chooses", [({}, True), ({"global_via_bridges": True}, True),
                                              ({"global_via_bridges": False}, False)])
def test_the_trial_of_a_plan_finds_its_global_places(options, chooses):
    """``OverlapTrial.of(plan, choose_globals=True)``: the periods of each half that hold a global average, the
    same places in both halves (whole cycles), where the plan has global averages on racks."""
    from hvd_dssync.plan import SyncPlan
    plan = SyncPlan(0, 8, schedule="topology", topology=[[0, 1, 2, 3], [4, 5, 6, 7]], average_every=8,
                    global_every=32 if chooses else 0, schedule_options=options)
    trial = OverlapTrial.of(plan, choose_globals=True)
    kinds = [[plan.action(s).kind for s in range(trial.first + k * 8, trial.first + (k + 1) * 8)]
             for k in range(2 * trial.blocks)]
    places = tuple(k for k, period in enumerate(kinds) if "global" in period)
    assert trial.globals_at == tuple(k for k in places if k < trial.blocks)
    assert tuple(k - trial.blocks for k in places if k >= trial.blocks) == trial.globals_at
    assert bool(trial.globals_at) is chooses


@pytest.mark.parametrize("average_every, global_every", [(2, 8), (8, 32), (4, 16)])
def test_a_global_average_in_flight_is_folded_in_a_step_after_it_started(average_every, global_every):
    """``folds_now``: every average in flight folds where a poll finds it done; a global average of the plan
    also once ``GLOBAL_FOLD_STEPS`` steps passed since it started, a rack's never before the next average."""
    from hvd_dssync.plan import SyncPlan
    plan = SyncPlan(rank=1, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]], average_every=average_every,
                    global_every=global_every, schedule_options={"intra_steps": None})
    started = [s for s in range(4 * global_every) if plan.action(s).kind != "local"]
    kinds = {plan.action(s).kind for s in started}
    assert kinds == {"group", "global"}, kinds
    for s in started:
        for later in range(s + 1, s + average_every):
            kind = plan.action(s).kind
            assert folds_now(kind, s, later, done=True)
            due = kind == "global" and later - s >= GLOBAL_FOLD_STEPS
            assert folds_now(kind, s, later, done=False) is due, (s, later)


@pytest.mark.parametrize("sizes, count", [([10, 2], 3), ([5_760_000, 2400, 153_600, 2400, 24_000, 10], 7),
                                          ([1, 1], 4), ([3], 1), ([7, 0, 5], 5)])
def test_the_fragments_cover_the_model_once_in_order_and_nearly_equal(sizes, count):
    """Every element of every tensor is in exactly one fragment, in the model's order; the fragments differ by
    an element at most, and none is empty."""
    fragments = fragment_ranges(sizes, count)
    assert len(fragments) == min(count, sum(sizes))
    covered = [(i, e) for parts in fragments for i, a, b in parts for e in range(a, b)] if sum(sizes) < 100 else None
    if covered is not None:
        assert covered == [(i, e) for i, n in enumerate(sizes) for e in range(n)]
    totals = [sum(b - a for _, a, b in parts) for parts in fragments]
    assert sum(totals) == sum(sizes) and max(totals) - min(totals) <= 1 and min(totals) > 0
    assert all(0 <= a < b <= sizes[i] for parts in fragments for i, a, b in parts)


@pytest.mark.parametrize("seed", range(4))
def test_the_fragments_end_between_rows_where_rows_are_given(seed):
    """The Keras adapter's cut (``rows``: a variable's elements in a row) on generated models: every element in
    exactly one fragment, in order; every part starts and ends between two rows of its tensor; none empty; at
    most ``count`` fragments, and as many as without rows where every row is one element."""
    rng = np.random.default_rng(seed)
    for _ in range(100):
        shapes = [tuple(int(d) for d in rng.integers(1, 6, size=rng.integers(0, 4))) for _ in range(rng.integers(1, 5))]
        sizes = [int(np.prod(s)) for s in shapes]
        rows = [int(np.prod(s[1:])) for s in shapes]  # a scalar's one element is its row
        count = int(rng.integers(1, 10))
        fragments = fragment_ranges(sizes, count, rows)
        covered = [(i, e) for parts in fragments for i, a, b in parts for e in range(a, b)]
        assert covered == [(i, e) for i, n in enumerate(sizes) for e in range(n)], (shapes, count)
        assert all(a % rows[i] == 0 and b % rows[i] == 0 for parts in fragments for i, a, b in parts), (shapes, count)
        assert 1 <= len(fragments) <= count and all(fragments)
        assert fragment_ranges(sizes, count, [1] * len(sizes)) == fragment_ranges(sizes, count)


@pytest.mark.parametrize("noise", [0.05, 0.2])
def test_the_fragments_hide_behind_a_step_each_under_noise(noise):
    """On noisy figures of a slow link (a ring of the whole model over 4 ranks 7 steps long), the fragments,
    each 1.5/n of the route across the racks, fit a step each (within the noise's reach: the ring's share of
    bytes over the step, rounded up) and never pass the period; the route where even a period's steps leave
    more exposed than the route costs."""
    rng = np.random.default_rng(int(100 * noise))
    for _ in range(200):
        route, step = 0.67 * rng.lognormal(0, noise), 0.14 * rng.lognormal(0, noise)
        count = global_fragments(route, step, 4, 8)
        assert 1 <= count <= 8
        assert count == 8 or 1.5 * route / count <= step + 1e-9
        assert count == 1 or 1.5 * route / (count - 1) > step
    assert global_fragments(0.38, 0.012, 8, 8) == 0  # the static cluster: 0.57 s left exposed against 0.38
    assert global_fragments(-0.01, 0.14, 4, 8) == 1  # the route cost nothing: one ring
    # Where the waited average was the ring itself (the Keras adapter), fragments always expose less than it.
    for _ in range(200):
        ring, step = 0.67 * rng.lognormal(0, noise), 0.14 * rng.lognormal(0, noise)
        count = global_fragments(ring, step, 4, 8, through_racks=False)
        assert 1 <= count <= 8 and (count == 8 or ring / count <= step + 1e-9)


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_count_of_fragments_is_named(value):
    with pytest.raises(ValueError, match=f"{FRAGMENTS_ENV}='{value}'"):
        forced_fragments({FRAGMENTS_ENV: value})


@pytest.mark.parametrize("globals_at, probe, fragments", [((2, 6), 0.12, 8), ((2, 6), 0.9, 0), ((), 0.12, 0)])
def test_the_probe_runs_after_the_set_up_and_the_chosen_way_is_warmed_untimed(globals_at, probe, fragments,
                                                                               monkeypatch):
    """``step_ended`` probes the global averages' way once, at the set-up period's last step (the adapter's
    ``probe(fragments)``: a ring of one of a period's fragments), and chooses it from every rank's probe and set-up
    local steps; then it warms the fragments, where chosen, once (the adapter's ``warm(way)``) there and then; the
    route is not warmed. Neither's seconds (here 1 s each on the test's clock)
    are in any period's figures. A trial that does not choose the global averages' way probes and warms nothing."""
    import types

    import hvd_dssync.overlap
    now = [0.0]
    monkeypatch.setattr(hvd_dssync.overlap, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    trial = OverlapTrial(0, 8, cycle=4, globals_at=globals_at, world_size=4)
    called = []

    def warm(way):
        called.append(("warm", step, way))
        now[0] += 1.0

    def probed(count):
        called.append(("probe", step, count))
        now[0] += 1.0
        return probe

    def gather(figures):  # four ranks alike
        return np.concatenate([figures] * 4)

    for step in range(trial.last + 1):
        now[0] += 0.13
        trial.step_ended(step, gather, local=(step + 1) % 8 != 0, warm=warm, probe=probed)
        if step == trial.first - 1:
            assert trial.global_fragments == fragments and trial.fragments_at(step + 1) == fragments
            assert not globals_at or trial.local_step == pytest.approx(0.13)
    warmed = [("warm", trial.first - 1, fragments)] if fragments else []  # the route is not warmed
    expected = [("probe", trial.first - 1, 8)] + warmed if globals_at else []
    assert called == expected
    timed = trial.figures()[0, :2 * trial.blocks]
    timed = timed[timed > 0]  # the periods timed before the trial decided (its first look, here)
    assert timed.size >= trial.blocks + trial.cycle and np.allclose(timed, 8 * 0.13)  # no probe, no warm


# Trials' periods of rank 0 (the others' were not recorded), waited then overlapped, on `python -m hvd_dssync bench
# --scenarios accelerator --ranks 4 --contenders dssync-default`, seeds 0-2 and 0 again, each way warmed before its
# half (the global averages through the racks in the waited half, in 6 fragments in the overlapped one, as the trial
# then timed them): the racks' places (0 and 1) saved -0.70-0.44 s a cycle.
ACCELERATOR_WARMED = [
    [1.54, 1.45, 3.20, 1.64, 1.50, 1.64, 2.36, 1.64, 1.81, 1.88, 1.57, 2.25, 1.59, 1.70, 1.64, 2.10],
    [1.66, 1.66, 3.17, 1.55, 1.74, 1.62, 2.56, 1.63, 1.53, 1.73, 1.59, 1.79, 1.58, 1.68, 1.59, 2.01],
    [1.75, 1.63, 2.69, 1.59, 1.69, 1.73, 2.34, 1.76, 1.50, 1.64, 1.44, 2.12, 1.48, 1.51, 1.58, 2.28],
    [1.50, 2.22, 2.82, 1.67, 1.54, 1.69, 2.14, 1.73, 1.90, 1.82, 1.55, 1.78, 1.61, 1.59, 1.60, 1.78]]


@pytest.mark.parametrize("recorded", ACCELERATOR_WARMED)
def test_the_racks_averages_on_recorded_figures_stay_waited_for(recorded):
    """On each recorded trial (every rank's periods as rank 0's) the racks' averages, which saved less than 5% of
    their periods beyond the noise in flight, stay waited for, whatever the places of the global averages did: they
    decide the fragments alone (with no local steps in these rows, nothing to weigh their exposure on: the
    route)."""
    trial = OverlapTrial(0, 8, cycle=4, globals_at=(2, 6), world_size=4)
    trial.global_fragments = 6
    assert trial.decide([recorded] * 4) is False
    assert trial.global_fragments == 0 and not trial.overlapping


# Rank 0's periods of the trial on a GPU machine's host (16 cores, 8 ranks: 2 cores each; `python -m hvd_dssync bench
# --scenarios accelerator --contenders dssync-default`, seeds 0-2, 2026-12-04), waited then overlapped, from its step
# times (step 23's, which the bench times with the route's warm after it, set to its racks' average as at the
# others): 8 fragments chosen; the racks' places (0 and 1) saved 0.15-0.18 s a cycle, 6.8-7.9% of 2.23 s.
GPU_HOST = [
    [1.106, 1.113, 1.764, 1.12, 1.118, 1.12, 1.735, 1.13, 1.041, 1.017, 1.034, 1.129, 1.063, 1.032, 1.009, 1.156],
    [1.134, 1.122, 1.747, 1.117, 1.107, 1.093, 1.777, 1.129, 1.039, 1.026, 1.035, 1.117, 1.02, 1.019, 1.009, 1.216],
    [1.135, 1.114, 1.719, 1.124, 1.12, 1.114, 1.741, 1.116, 1.087, 1.007, 0.996, 1.186, 1.032, 1.024, 1.028, 1.101]]


def _fragments_trial():
    trial = OverlapTrial(0, 8, cycle=4, globals_at=(2, 6), world_size=8)
    trial.global_fragments = 8
    return trial


@pytest.mark.parametrize("recorded", GPU_HOST)
def test_the_racks_averages_folded_a_step_late_need_a_steps_share_of_the_gain(recorded):
    """Those racks' averages saved 7% of their periods in flight, which the rule of a period's staleness (5%, less 2.5
    standard errors) did not keep in two jobs of three (the job's own decision, on every rank's figures: the
    fragments alone in all three). Folded in a step after they started, they need save an eighth of that."""
    waited_for, one_step, a_period = _fragments_trial(), _fragments_trial(), _fragments_trial()
    untold = waited_for.decide([recorded] * 8)  # no folds in the rows: as late as the next average
    assert one_step.decide([recorded + [6.0, 6.0]] * 8) is True and one_step.staleness == 1.0  # the folds: 6 averages
    assert a_period.decide([recorded + [48.0, 6.0]] * 8) is untold and a_period.staleness == 8.0
    assert one_step.describe().endswith("; the others folded in 1 step late)")


@pytest.mark.parametrize("saving, folded_after, kept_at_least, kept_at_most", [
    (0.07, 1, 0.9, 1.0), (0.07, 8, 0.0, 0.3), (0.05, 1, 0.6, 1.0), (0.0, 1, 0.0, 0.05), (-0.05, 1, 0.0, 0.0),
    (0.03, 8, 0.0, 0.05)])
def test_the_racks_averages_under_noise_by_their_staleness(saving, folded_after, kept_at_least, kept_at_most):
    """Generated trials of 8 ranks at the GPU host's spread (each period's seconds 1% of noise on each rank, the
    ranks' shared part of it 2%): the racks' averages in flight, folded a step after they start, are kept in most
    trials where they save 5% or 7% of their periods (92% of trials at 7%, against 23% folded a period late),
    rarely where they save nothing, never where they cost; folded a period late, 3% is not enough."""
    rng = np.random.default_rng(7)
    waited = np.array([1.12, 1.12, 1.75, 1.12] * 2)
    overlapped = np.array([1.12 * (1 - saving), 1.12 * (1 - saving), 1.03, 1.13] * 2)
    kept = 0
    for _ in range(200):
        shared = rng.normal(0.0, 0.02, 16)  # what the ranks share: they wait for each other
        rows = [np.concatenate([np.concatenate([waited, overlapped]) * (1 + shared + rng.normal(0.0, 0.01, 16)),
                                [6.0 * folded_after, 6.0]]) for _ in range(8)]
        kept += _fragments_trial().decide(rows)
    assert kept_at_least * 200 <= kept <= kept_at_most * 200, kept


def test_a_trial_counts_the_folds_of_its_overlapped_half_but_the_global_ones():
    trial = OverlapTrial(start=0, period=8, cycle=4, globals_at=(2, 6))  # the overlapped half: steps 72-135
    trial.note_fold(20, "group", 15)  # the waited half's: not counted
    for started in (79, 87, 95):
        trial.note_fold(started + 2, "group", started)
    trial.note_fold(96, "global", 95)  # a fragment's fold: a step late by rule
    assert trial.figures()[0, -2:].tolist() == [6.0, 3.0]
    assert staleness(trial.figures()[:, -2:], 8) == 2.0 and staleness([[0.0, 0.0]], 8) == 8.0


@pytest.mark.parametrize("fold, kept", [(0.06, True), (0.18, False)])
def test_the_fragments_are_kept_by_what_they_left_exposed_against_the_routes_price(fold, kept):
    """The accelerator's spread (4 ranks, 100 trials): a local step of 0.19 s (noise 0.1), a rack's average 0.12 s
    (noise 0.2), each rank's probe of a period's fragment 0.11 s (noise 0.3: the route's bridge priced at 0.6 s, the
    route at 0.72 s with a rack's average), and each of the fragments' 7 steps ``fold`` s longer (noise 0.3), in
    both halves. Fragments that leave 0.42 s exposed are kept in 95 trials at least; fragments that leave 1.26 s,
    in 10 at most (the route, whose price they pass)."""
    rng = np.random.default_rng(int(fold * 100))
    chosen = 0
    for _ in range(100):
        trials = [OverlapTrial(0, 8, cycle=4, globals_at=(2, 6), world_size=4) for _ in range(4)]
        first = trials[0]
        for step in range(first.last + 1):
            averaging, place, into = (step + 1) % 8 == 0, (step - first.first) // 8 % 4, (step - first.first) % 8
            in_flight = first.fragments_at(step) and ((averaging and place == 2) or (place == 3 and into < 6))
            route = 0.72 * rng.lognormal(0.0, 0.3) if averaging and place == 2 and not in_flight else 0.0
            for trial in trials:
                seconds = 0.19 * rng.lognormal(0.0, 0.1) + route
                seconds += 0.12 * rng.lognormal(0.0, 0.2) if averaging and place != 2 else 0.0
                seconds += fold * rng.lognormal(0.0, 0.3) if in_flight else 0.0
                trial.note(step, seconds, local=not averaging)
            decide_where_due(trials, step, lambda rank: 0.1125 * rng.lognormal(0.0, 0.3))
        assert len({t.global_fragments for t in trials}) == 1
        chosen += first.global_fragments > 0
    assert chosen >= 95 if kept else chosen <= 10, chosen
