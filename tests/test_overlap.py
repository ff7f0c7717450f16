"""The default's trial of overlap (hvd_dssync.overlap): the rule alone, on generated noisy step times."""
import numpy as np
import pytest

from hvd_dssync.overlap import MIN_GAIN, OverlapTrial, runs_trial


def trial_of(rng, ranks, compute, average, hidden, noise, period=4, cycle=4):
    """Run one trial on ``ranks`` ranks whose steps take ``compute`` seconds each (times a log-normal factor of
    sigma ``noise``) plus, at each averaging step, ``average`` seconds waited for, or ``(1 - hidden)`` of it
    overlapped; every rank's decision (they must agree)."""
    trials = [OverlapTrial(0, period, cycle) for _ in range(ranks)]
    for step in range(trials[0].last + 1):
        for trial in trials:
            seconds = compute * rng.lognormal(0.0, noise)
            if (step + 1) % period == 0:
                seconds += average * (1.0 - hidden if trial.overlap_at(step) else 1.0) * rng.lognormal(0.0, noise)
            trial.note(step, seconds)
    assert all(t.due(trials[0].last) for t in trials)
    gathered = np.concatenate([t.figures() for t in trials])
    return [t.decide(gathered) for t in trials]


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
    assert (trial.first, trial.length, trial.last) == (6, 16, 37)
    assert [trial.overlap_at(s) for s in (5, 6, 21, 22, 37)] == [False, False, False, True, True]
    assert trial.describe() == "overlap: on trial"
    trial.note(3, 9.0)  # before the trial: not counted
    for step in range(6, 38):
        trial.note(step, 0.3 if step < 22 else 0.24)
    mine = trial.figures()
    assert np.allclose(mine, [[1.2] * 4 + [0.96] * 4])
    noisy = mine + np.array([[0.01, -0.01, 0.02, 0.0, 0.01, 0.0, -0.01, 0.02]])
    assert trial.decide(np.concatenate([mine, noisy])) is True and trial.overlap_at(100) is True
    assert trial.describe() == "overlap on (the overlapped steps 20% shorter)"
    assert not trial.due(37)  # decided once
    # Shorter, but under MIN_GAIN; then shorter by 20% on average but within its noise: off both times.
    assert OverlapTrial(0, 1).decide([[0.2, 0.21, 0.2, 0.19] + [0.2 * (1 - MIN_GAIN / 2)] * 4]) is False
    assert OverlapTrial(0, 1).decide([[0.2, 0.2, 0.2, 0.2, 0.1, 0.3, 0.05, 0.19]]) is False


def test_ruled_out_or_not_run():
    trial = OverlapTrial(0, 4)
    trial.rule_out()
    assert trial.overlap_at(50) is False and trial.describe() == "overlap off (no trial)"
    assert runs_trial(None, False, False, 8, True)
    for arguments in ((False, False, False, 8, True), (True, False, False, 8, True), (None, True, False, 8, True),
                      (None, False, True, 8, True), (None, False, False, 1, True), (None, False, False, 8, False)):
        assert not runs_trial(*arguments), arguments
