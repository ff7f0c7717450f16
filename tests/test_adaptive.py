"""The adaptive policy: decisions on recorded figures (no communication), and a real 4-rank job."""
import copy
import math

import numpy as np
import pytest

from hvd_dssync.adaptive import (FIGURES, AdaptivePolicy, AdaptiveState, decide, decode_figures, drift_of,
                                 encode_figures, initial_decision)
from hvd_dssync.plan import SyncPlan, agreement_fields
from hvd_dssync.policy import GLOBAL, GROUP, LOCAL
from hvd_dssync.topology import Topology

from multirank import run

NAN = float("nan")


def rows(compute, global_seconds, group_seconds, drift=0.0, ranks=4, costliest_group=None):
    costliest_group = group_seconds if costliest_group is None else costliest_group
    return [[compute, global_seconds, group_seconds, drift, costliest_group]] * ranks


def play(policy, timeline, start=None):
    """Decide once per recorded window; ``timeline`` lists (compute, global, group, drift) per window."""
    decision, out = start or initial_decision(policy), []
    for window, figures in enumerate(timeline):
        decision = decide(rows(*figures), decision, policy, (window + 1) * policy.decide_every - 1)
        out.append(decision)
    return out


def test_switches_to_groups_when_a_link_slows_and_back_when_it_recovers():
    p = AdaptivePolicy(decide_every=8, max_period=1)
    fast, slow = (0.05, 0.010, 0.008), (0.05, 0.400, 0.010)
    modes = [d.mode for d in play(p, [fast, fast, slow, slow, fast, fast])]
    assert modes == [GLOBAL, GLOBAL, GROUP, GROUP, GLOBAL, GLOBAL]


def test_a_straggler_paces_both_modes_so_it_keeps_global_averages():
    """Under group averages a straggler's partners wait for it, their next partners for them, and so on:
    the slowest rank paces both modes, and group averages save only what the averages cost."""
    p = AdaptivePolicy(decide_every=16, min_period=4, max_period=8)
    even = [[0.010, 0.02, 0.015, 0.0, 0.015]] * 8
    straggler = even[:7] + [[0.260, 0.02, 0.015, 0.0, 0.015]]  # one rank computes 26x slower
    slow_link = [[0.260, 1.0, 0.015, 0.0, 0.015]] + [[0.010, 1.0, 0.015, 0.0, 0.015]] * 7  # and global ones 50x slower
    decisions, decision = [], initial_decision(p)
    for figures in (even, straggler, straggler, slow_link, even):
        decision = decide(figures, decision, p, 15)
        decisions.append(decision)
    assert [d.mode for d in decisions] == [GLOBAL, GLOBAL, GLOBAL, GROUP, GLOBAL]
    assert 0 < decisions[1].gain < 0.01 and decisions[1].compute_seconds == 0.26
    assert decisions[3].gain > 0.3


def run_ranks(policy, steps, compute_of, global_seconds_of, group_seconds=0.01, ranks=4, kinds=None):
    """Play ``steps`` on ``ranks`` states as the PyTorch adapter does (:meth:`AdaptiveState.end_step`), the
    figures riding along every average that carries them, else gathered after the step, and exchanged
    before an early check's average (:meth:`AdaptiveState.check_early`); returns the
    decisions (step, mode) of rank 0 and checks that every rank took the same. ``group_seconds``: a
    number, or a function of the step. ``kinds``: a list to append each step's kind to."""
    group_seconds_of = group_seconds if callable(group_seconds) else lambda step: group_seconds
    states = [AdaptiveState(policy) for _ in range(ranks)]
    taken = []
    for step in range(steps):
        sent = [s.early_figures(step) for s in states]
        assert len({e is None for e in sent}) == 1
        if sent[0] is not None:  # summed, as the allreduce does
            summed = decode_figures(sum(encode_figures(r, k, ranks) for k, r in enumerate(sent)), ranks)
            early = [s.check_early(step, summed) for s in states]
            assert len({None if d is None else (d.mode, d.period) for d in early}) == 1, early
            if early[0] is not None:
                taken.append((step, early[0].mode))
        kind = states[0].action(step)
        assert {s.action(step) for s in states} == {kind}
        if kinds is not None:
            kinds.append(kind)
        seconds = {GLOBAL: global_seconds_of(step), GROUP: group_seconds_of(step)}.get(kind, NAN)
        carried = [s.carried_figures(step) for s in states]
        assert len({c is None for c in carried}) == 1
        gathered = None
        if carried[0] is not None:  # every rank fills its own slots of the average
            gathered = decode_figures(sum(encode_figures(r, k, ranks) for k, r in enumerate(carried)), ranks)
        after = _figures_after(states, kind, seconds, [compute_of(step, r) for r in range(ranks)])

        def gather(figures, rank):
            assert np.array_equal(figures[0], after[rank], equal_nan=True), (figures, after[rank])
            return after

        made = [s.end_step(step, kind, seconds, compute_of(step, rank), gathered=gathered,
                           gather=lambda f, rank=rank: gather(f, rank)) for rank, s in enumerate(states)]
        assert len({None if d is None else (d.mode, d.period) for d in made}) == 1, made
        if made[0] is not None:
            taken.append((step, made[0].mode))
    return taken


def _figures_after(states, kind, seconds, computes):
    """What an allgather after the step returns: every rank's figures once it has recorded the step."""
    twins = [copy.deepcopy(s) for s in states]
    for twin, compute in zip(twins, computes):
        twin.record(kind, seconds, compute)
    return np.concatenate([twin.figures() for twin in twins])


def test_a_slowed_link_inside_a_window_is_answered_at_the_next_global_average():
    """Global averages 10x slower from step 17 on: the window of steps 16-31 would decide at step 31; the
    slow average of step 19 rides along the global average of step 23 and switches there already, or, with
    the figures exchanged before each early check, makes step 23's average a group one. A straggler from
    step 20 on switches nothing: it paces group averages as well."""
    even = lambda step, rank: 0.01  # noqa: E731
    slowed = lambda step: 0.2 if step >= 17 else 0.02  # noqa: E731
    early, kinds = AdaptivePolicy(decide_every=16, min_period=4, max_period=4), []
    assert run_ranks(early, 32, even, slowed, kinds=kinds)[1:] == [(23, GROUP)]
    assert [kinds[step] for step in (19, 23, 27)] == [GLOBAL, GLOBAL, GROUP]  # two slow global averages
    exchange, kinds = AdaptivePolicy(decide_every=16, min_period=4, max_period=4, switch_early="exchange"), []
    assert run_ranks(exchange, 32, even, slowed, kinds=kinds)[1:] == [(23, GROUP)]
    assert [kinds[step] for step in (19, 23, 27)] == [GLOBAL, GROUP, GROUP]  # one slow global average
    late = AdaptivePolicy(decide_every=16, min_period=4, max_period=4, switch_early=False)
    assert run_ranks(late, 32, even, slowed)[1:] == [(31, GROUP)]
    straggler = lambda step, rank: 0.25 if rank == 3 and step >= 20 else 0.01  # noqa: E731
    for policy in (early, exchange):
        assert {mode for _, mode in run_ranks(policy, 48, straggler, lambda step: 0.02)} == {GLOBAL}


def test_the_first_window_averages_in_groups_and_its_costliest_group_average_stands_in_for_a_global_one():
    """The ranks start with group averages, with no global one in the first window: at its end they gather
    their figures and take a global average to cost what the costliest group average cost. Behind a slow
    link between the racks (the schedule's bridge, the 4th average, costs 0.5 s) they keep group averages
    until the first probe; on a fast network (every average alike) they average globally from then on."""
    even = lambda step, rank: 0.01  # noqa: E731
    p = AdaptivePolicy(decide_every=16, min_period=4, max_period=4)
    assert [AdaptiveState(p).action(t) for t in (3, 7, 11, 15)] == [GROUP] * 4
    bridged = lambda step: 0.5 if step % 16 == 15 else 0.01  # noqa: E731
    assert run_ranks(p, 64, even, lambda step: 0.6, group_seconds=bridged) == [(15, GROUP), (63, GROUP)]
    assert run_ranks(p, 32, even, lambda step: 0.012, group_seconds=0.012) == [(15, GLOBAL), (31, GLOBAL)]
    first = decide(rows(0.01, NAN, 0.01, costliest_group=0.5), initial_decision(p), p, 15)
    assert math.isnan(first.global_seconds) and first.costliest_group_seconds == 0.5, first
    assert "taken to cost the costliest group one" in first.reason
    # A probe that finds a global average cheaper than the estimate goes back to global averages.
    assert decide(rows(0.01, 0.012, 0.01), first, p, 63).mode == GLOBAL
    # On a fast network the costliest group average is the typical one plus noise and waits: below
    # raise_ratio (2x) times it, the estimate shows no slow link, whatever it would save.
    noisy = decide(rows(0.001, NAN, 0.1, costliest_group=0.16), initial_decision(p), p, 15)
    assert noisy.mode == GLOBAL and noisy.gain > p.enter_gain and "no slow link seen" in noisy.reason, noisy
    assert decide(rows(0.001, NAN, 0.1, costliest_group=0.2), initial_decision(p), p, 15).mode == GROUP
    # Between the two gains the first decision goes as a switch from global averages would: global.
    middle = decide(rows(0.01, NAN, 0.065, costliest_group=0.08), initial_decision(p), p, 15)
    assert middle.mode == GLOBAL and 0.1 < middle.gain < 0.3, middle


@pytest.mark.parametrize("bridge, seen, expected", [(0.3, 0.18, GROUP), (0.07, 0.12, GLOBAL)])
def test_the_first_estimate_is_the_bridge_ranks_own_time(bridge, seen, expected):
    """On 2 racks of 4 only the bridge ranks (3 and 7) cross at the topology-aware schedule's bridge step;
    the others wait for them only in part (Horovod's cycles). The estimate of a global average is the
    crossing ranks' time, the median over them: behind a slow link (a bridge of 0.3 s, which the others see
    as 0.18 s against their usual 0.1 s, less than raise_ratio) the ranks keep group averages; on a fast
    network (the bridge pair cheaper than the racks' averages) they average globally."""
    policy = AdaptivePolicy(decide_every=16, min_period=4, max_period=4).config()
    racks = Topology.from_racks([[0, 1, 2, 3], [4, 5, 6, 7]])
    plans = [SyncPlan(rank, 8, schedule="topology", topology=racks, adaptive=policy) for rank in range(8)]
    for step in range(16):
        for plan in plans:
            action = plan.action(step)
            crossing = action.kind == GROUP and len(action.group) == 2
            seconds = bridge if crossing else seen if step == 15 else 0.1
            plan.adaptive.record(action.kind, seconds if action.kind == GROUP else NAN, 0.01)
    figures = np.concatenate([plan.adaptive.figures() for plan in plans])
    assert np.isfinite(figures[:, 4]).tolist() == [rank in (3, 7) for rank in range(8)]  # the others crossed none
    first = plans[0].adaptive.conclude(15, figures)
    assert first.mode == expected and first.costliest_group_seconds == bridge, first
    # Every rank's costliest group average, the median over all ranks, would have missed the slow bridge.
    everyone = figures.copy()
    everyone[:, 4] = [bridge if rank in (3, 7) else seen for rank in range(8)]
    assert decide(everyone, initial_decision(plans[0].adaptive.policy), plans[0].adaptive.policy, 15).mode == GLOBAL


@pytest.mark.parametrize("bridge, waited, expected", [(0.3, 0.25, GROUP), (0.12, 0.1, GLOBAL)])
def test_a_first_window_at_the_longest_period_ends_at_a_bridge(bridge, waited, expected):
    """With ``first_period=8`` the first window of 16 steps holds two averages: the schedule starts where
    they are the last step inside the racks and a bridge (``first_crossing``). Each rank's group figure is
    the cheaper of the two (the lower median), not their mean: the ranks that stay in their racks at the
    bridge step wait for it, which is no group average's cost. Behind a slow link the ranks keep group
    averages, on a fast network they average globally; either way the next window averages every 4 steps."""
    policy = AdaptivePolicy(decide_every=16, min_period=4, max_period=8, first_period=8).config()
    racks = Topology.from_racks([[0, 1, 2, 3], [4, 5, 6, 7]])
    plans = [SyncPlan(rank, 8, schedule="topology", topology=racks, adaptive=policy, average_every=4)
             for rank in range(8)]
    averaged = []
    for step in range(16):
        for plan in plans:
            action = plan.action(step)
            if plan.rank == 3 and action.kind != LOCAL:  # a bridge rank
                averaged.append((step, action.group))
            seconds = (bridge if len(action.group) == 2 else waited) if step == 15 else 0.1
            plan.adaptive.record(action.kind, seconds if action.kind == GROUP else NAN, 0.01)
    assert averaged == [(7, (0, 1, 2, 3)), (15, (3, 7))]  # inside the rack, then the bridge
    figures = np.concatenate([plan.adaptive.figures() for plan in plans])
    assert figures[:, 2].tolist() == [0.1] * 8
    decisions = [plan.adaptive.conclude(15, figures) for plan in plans]
    assert {(d.mode, d.period) for d in decisions} == {(expected, 4)}, decisions[0]
    assert [step for step in range(16, 32) if plans[0].action(step).kind != LOCAL] == [19, 23, 27, 31]


def test_a_link_that_slows_inside_a_window_shows_at_its_end():
    """Each rank's global figure is the fewer seconds of the window's last two global averages: a link that
    slowed after the window's first average (steps 23 and 27 slow, 19 fast) switches at the window's end
    (step 31), not one window later; one slow average among them (a stall) switches nothing."""
    even = lambda step, rank: 0.01  # noqa: E731
    late = AdaptivePolicy(decide_every=16, min_period=4, max_period=4, switch_early=False)
    assert run_ranks(late, 48, even, lambda step: 0.2 if step >= 21 else 0.02)[1:] == [(31, GROUP)]
    assert {mode for _, mode in run_ranks(late, 48, even, lambda step: 0.2 if step == 27 else 0.02)} == {GLOBAL}


def test_one_slow_step_inside_a_period_is_no_straggler():
    """Rank 3 is slow on two steps of one period (an evaluation, a stall), then fast again: no switch."""
    spiky = lambda step, rank: 0.25 if rank == 3 and step in (21, 22) else 0.01  # noqa: E731
    p = AdaptivePolicy(decide_every=16, min_period=4, max_period=4)
    assert {mode for _, mode in run_ranks(p, 48, spiky, lambda step: 0.02)} == {GLOBAL}


def test_one_slow_global_average_inside_a_window_switches_only_when_far_slower():
    """Group averages (0.06 s a period with the compute) save 60% against a global average of 0.1 s: more
    than enter_gain (30%), but one such average is no trend; two in a row switch. One of 0.5 s (group
    averages save 89%, beyond halfway from 30% to all, 65%) switches at the next global average."""
    even = lambda step, rank: 0.05  # noqa: E731
    p = AdaptivePolicy(decide_every=8, max_period=1)
    once = run_ranks(p, 24, even, lambda step: 0.1 if step == 10 else 0.02)
    assert all(mode == GLOBAL for _, mode in once), once
    twice = run_ranks(p, 24, even, lambda step: 0.1 if step >= 10 else 0.02)
    assert twice[1] == (12, GROUP), twice  # after the second slow one, inside the window of steps 8-15
    far = run_ranks(p, 24, even, lambda step: 0.5 if step == 10 else 0.02)
    assert far[1] == (11, GROUP), far


def test_the_deciding_average_counts_as_the_last_one():
    """Global averages 10x slower from step 15, the last of the second window (its own average decides
    there, from the window's earlier figures): the next global average carries its time and switches."""
    even = lambda step, rank: 0.05  # noqa: E731
    p = AdaptivePolicy(decide_every=8, max_period=1)
    taken = run_ranks(p, 24, even, lambda step: 0.5 if step >= 15 else 0.02)
    assert taken[:3] == [(7, GLOBAL), (15, GLOBAL), (16, GROUP)], taken


def test_hysteresis_keeps_a_mode_between_the_two_gains():
    p = AdaptivePolicy(decide_every=8, max_period=1, enter_gain=0.3, leave_gain=0.1)
    # A group average saves 20% of a period: not enough to leave global averages, nor to leave groups.
    middle = (0.05, 0.0725, 0.05)
    assert {d.mode for d in play(p, [middle] * 5)} == {GLOBAL}
    grouped = initial_decision(p)._replace(mode=GROUP, step=7)  # a decision taken, not the start
    assert {d.mode for d in play(p, [middle] * 5, start=grouped)} == {GROUP}
    # Noisy figures around the middle never flap.
    rng = np.random.default_rng(0)
    noisy = [(0.05, 0.0725 * rng.uniform(0.9, 1.1), 0.05 * rng.uniform(0.9, 1.1)) for _ in range(50)]
    assert len({d.mode for d in play(p, noisy)}) == 1


def test_period_follows_the_cost_of_an_average_against_its_least():
    p = AdaptivePolicy(decide_every=16, max_period=8)  # periods 1, 2, 4, 8: up at 2x per level, down at 1.5x
    costs = (0.01, 0.012, 0.025, 0.05, 0.1, 0.1, 0.05, 0.02, 0.014, 0.01)
    decisions = play(p, [(0.01, c, c) for c in costs])  # group averages save nothing: global throughout
    assert [d.period for d in decisions] == [1, 1, 2, 4, 8, 8, 4, 2, 1, 1]
    assert {d.mode for d in decisions} == {GLOBAL} and {d.global_floor for d in decisions} == {0.01}
    # A network that is slow from the start keeps the user's period: the cost is measured against its least.
    assert {d.period for d in play(p, [(0.01, 0.5, 0.5)] * 4)} == {1}
    # Noise around a threshold does not flap: between 1.5x and 2x the period stays where it is.
    rng = np.random.default_rng(0)
    noisy = [(0.01, 0.01, 0.01)] + [(0.01, c, c) for c in 0.0175 * rng.uniform(0.9, 1.1, 40)]
    assert len({d.period for d in play(p, noisy)[1:]}) == 1


def test_decisions_come_only_at_windows_that_end_with_a_global_average():
    p = AdaptivePolicy(decide_every=8, max_period=4, probe_every=2)
    state = AdaptiveState(p)
    state.decision = state.decision._replace(period=4)
    # Group averages: the ranks decide at the first window's end (their figures gathered) and at the probe
    # windows' (every probe_every-th), which end with a global average.
    assert state.is_decision_step(7)
    state.decision = state.decision._replace(step=7)  # what the ranks decided there
    assert [t for t in range(8, 32) if state.is_decision_step(t)] == [15, 31]
    # Global averages: every window ends with one.
    state.decision = state.decision._replace(mode=GLOBAL)
    assert [t for t in range(32) if state.is_decision_step(t)] == [7, 15, 23, 31]


@pytest.mark.parametrize("size", [2, 8, 1000])
def test_figures_ride_along_an_average_and_every_rank_reads_the_same(size):
    import torch

    rng = np.random.default_rng(size)
    figures = rng.uniform(0, 3, (size, len(FIGURES)))
    figures[rng.random((size, len(FIGURES))) < 0.2] = NAN
    slots = [torch.from_numpy(encode_figures(figures[r], r, size)).float() for r in range(size)]
    # Summed in two different orders, as two ranks' collectives might, then averaged: the same bits.
    forward = torch.stack(slots).sum(0) / size
    backward = torch.stack(slots[::-1]).cumsum(0)[-1] / size
    assert torch.equal(forward, backward)
    decoded = decode_figures(forward.double().numpy(), size, averaged=True)
    assert np.array_equal(np.isnan(decoded), np.isnan(figures))
    assert np.nanmax(np.abs(decoded - figures)) <= 1e-5


def test_the_slowest_rank_paces_and_missing_figures_keep_their_last_value():
    p = AdaptivePolicy(decide_every=8, max_period=1)
    # Rank 1 slow inside the global average: every rank waits for it, the rank arriving last included.
    figures = [[0.05, 0.51, NAN, 0.0, NAN], [0.05, 0.50, NAN, 0.0, NAN], [0.08, 0.52, 0.01, 0.0, 0.01],
               [0.05, 0.53, NAN, 0.0, NAN]]
    first = decide(figures, initial_decision(p), p, 7)
    assert (first.mode, first.global_seconds, first.group_seconds, first.compute_seconds) == (GROUP, 0.5, 0.01, 0.08)
    second = decide([[0.05, NAN, 0.012, NAN, 0.02]] * 4, first, p, 15)  # no global average measured this window
    assert (second.mode, second.global_seconds) == (GROUP, 0.5)
    # A probe after group averages: the ranks arrive at different times; the last to arrive measures the cost.
    skewed = [[0.05, g, 0.01, 0.0, 0.01] for g in (0.30, 0.20, 0.012, 0.1)]
    assert decide(skewed, second, p, 23).mode == GLOBAL
    unknown = decide([[0.05, 0.01, NAN, NAN, NAN]] * 4, initial_decision(p)._replace(mode=GLOBAL, step=7), p, 15)
    assert unknown.mode == GLOBAL and math.isnan(unknown.gain)


def test_drift_above_the_bound_ends_the_next_window_with_a_global_average():
    """A global average right after the deciding one would find the models just averaged: drift control
    brings the next probe forward instead, to the end of the next window."""
    p = AdaptivePolicy(decide_every=4, max_period=1, drift_bound=0.01, probe_every=100)
    state = AdaptiveState(p)
    state.decision = initial_decision(p)._replace(mode=GROUP, step=3, global_seconds=0.5)
    for step in range(4, 8):
        kind = state.action(step)
        state.record(kind, 0.5 if kind == GLOBAL else 0.01, 0.05, drift=0.02 if step == 6 else 0.001)
    decision = state.conclude(7, np.concatenate([state.figures()] * 2))
    assert decision.sync_now and "drift" in decision.reason
    assert [state.action(t) for t in range(8, 12)] == [GROUP, GROUP, GROUP, GLOBAL]
    assert state.is_decision_step(11) and not state.rides_along(11)  # a probe: figures gathered after it
    # The windows after that one, until the next decision (probe_every is large), average in groups.
    assert [state.action(t) for t in range(12, 20)] == [GROUP] * 8


def test_a_straggler_s_partners_waiting_in_their_group_averages_bring_global_averages_back():
    """Under group averages the straggler's partners wait for it inside their group averages: the median
    rank's group average, not the largest, is what groups cost, and the straggler paces both modes, so
    group averages, no cheaper than a global one here, save nothing."""
    p = AdaptivePolicy(decide_every=16, min_period=4, max_period=4)
    grouped = initial_decision(p)._replace(mode=GROUP, global_seconds=0.07, group_seconds=0.08)
    fast = [0.01, 0.07, 0.08, 0.0, 0.08]
    partners = [0.01, 0.07, 1.0, 0.0, 1.0]  # waited about 4 x 0.25 s for the straggler in each group average
    straggler = [0.25, 0.07, 0.08, 0.0, 0.08]
    figures = [fast] * 4 + [partners] * 3 + [straggler]
    decision = decide(figures, grouped, p, 15)
    assert decision.mode == GLOBAL and decision.group_seconds == 0.08 and decision.compute_seconds == 0.25, decision


def test_probes_give_the_mode_not_in_use_fresh_figures():
    p = AdaptivePolicy(decide_every=8, max_period=2, probe_every=2, first_period=1)
    state = AdaptiveState(p, warmup_steps=1)
    # The first window: group averages only, here every step (the ranks gather their figures at its end).
    assert [state.action(t) for t in range(10)] == ["bsp"] + [GROUP] * 9
    assert state.is_decision_step(8) and not state.rides_along(8)
    # Global averages: no probe (the group figure is kept from the last group window).
    state.decision = state.decision._replace(mode=GLOBAL, step=8)
    assert {state.action(t) for t in range(9, 41)} == {GLOBAL}
    # Group averages every 2 steps: the last average of a probe window is global (the last rank to arrive
    # measures the collective alone); its figures are gathered after it.
    state.decision = state.decision._replace(mode=GROUP, period=2)
    probe = [LOCAL, GROUP, LOCAL, GROUP, LOCAL, GROUP, LOCAL, GLOBAL]
    assert [state.action(t) for t in range(9, 41)] == probe + [LOCAL, GROUP] * 4 + probe + [LOCAL, GROUP] * 4
    # The global figure is a rank's fewest seconds: the collective without the wait for late ranks.
    for kind, seconds in ((GLOBAL, 0.3), (GLOBAL, 0.02), (GROUP, 0.01), (GROUP, 0.03), (GROUP, 0.02)):
        state.record(kind, seconds, 0.05)
    assert state.figures()[0, :3].tolist() == [0.05, 0.02, 0.02]


def test_plan_follows_the_decisions_and_advances_the_schedule_once_per_average():
    """Global averages advance the schedule too: a probe takes the place of a step of the schedule."""
    plan = SyncPlan(0, 4, schedule="butterfly", adaptive=AdaptivePolicy(decide_every=2, max_period=1).config())
    plan.adaptive.decision = plan.adaptive.decision._replace(mode=GROUP, step=1)
    groups = []
    for step in range(2, 6):
        action = plan.action(step)
        groups.append(action.group)
        plan.adaptive.record(action.kind, 0.01)
    assert groups == [(0, 1), (0, 2), (0, 1), (0, 2)]
    plan.adaptive.record(GLOBAL, 0.5)  # a global average: the schedule's step 4 (pairs (0, 1)) passes
    assert plan.adaptive.schedule_step(8) == 5 and plan.action(8).group == (0, 2)
    other = SyncPlan(0, 4, schedule="butterfly", adaptive=AdaptivePolicy(decide_every=4, max_period=1).config())
    assert agreement_fields(plan)["adaptive"] != agreement_fields(other)["adaptive"]  # the ranks compare it
    restored = SyncPlan(0, 4, schedule="butterfly", adaptive=plan.adaptive.policy.config())
    restored.adaptive.load(plan.adaptive.state())
    assert restored.action(6) == plan.action(6)


def test_drift_from_norms():
    models = np.array([[1.0, 2.0], [3.0, 2.0], [2.0, 5.0]])
    mean = models.mean(axis=0)
    exact = np.sqrt(((models - mean) ** 2).sum(axis=1).mean()) / np.linalg.norm(mean)
    assert drift_of((models ** 2).sum(axis=1).mean(), (mean ** 2).sum()) == pytest.approx(exact)
    assert drift_of(4.0, 4.0000001) == 0.0


@pytest.mark.parametrize("bad, message", [
    (dict(decide_every=0), "Arg ``decide_every`` must be a positive integer"),
    (dict(decide_every=12, max_period=8), "multiple of every period"),
    (dict(enter_gain=0.1, leave_gain=0.2), "Arg ``leave_gain``"),
    (dict(raise_ratio=0.9), "Arg ``raise_ratio`` must be a ratio above 1"),
    (dict(raise_ratio=1.5, lower_ratio=1.8), "Arg ``lower_ratio``"),
    (dict(drift_bound=-1.0), "Arg ``drift_bound``"),
    (dict(switch_early="sometimes"), "Arg ``switch_early`` must be True, False or 'exchange'"),
    (dict(first_period=0), "Arg ``first_period`` must be a positive integer"),
    (dict(max_period=8, first_period=3), "Arg ``first_period`` must be one of the periods the policy may choose"),
])
def test_bad_settings_name_the_argument(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        AdaptivePolicy(**bad)


def test_resolve():
    assert AdaptivePolicy.resolve(None) is None and AdaptivePolicy.resolve("fixed") is None
    assert AdaptivePolicy.resolve("adaptive", average_every=2).periods() == (2, 4, 8, 16)
    resolved = AdaptivePolicy.resolve(AdaptivePolicy(decide_every=16, first_period=8), average_every=4)
    assert (resolved.periods(), resolved.first_period) == ((4, 8), 8)
    with pytest.raises(ValueError, match="Arg ``policy``"):
        AdaptivePolicy.resolve("sometimes")
    with pytest.raises(ValueError, match="Arg ``global_every``"):
        AdaptivePolicy.resolve("adaptive", global_every=4)


def test_probes_take_the_place_of_the_topology_schedule_s_bridge_steps():
    """With 4 averages a window and the topology-aware schedule's cycle of 4 (3 steps inside the racks, then
    a bridge), every window ends where the schedule would cross the racks: a probe replaces a bridge."""
    from hvd_dssync.schedules import TopologyAware

    schedule = TopologyAware(Topology.from_racks([[0, 1, 2, 3], [4, 5, 6, 7]]))
    state = AdaptiveState(AdaptivePolicy(decide_every=16, min_period=4, max_period=4, probe_every=2))
    crossing = []
    for step in range(64):
        kind = state.action(step)
        if kind == GROUP:
            crossing.append(any(len({r // 4 for r in g}) > 1 for g in schedule.groups(state.schedule_step(step))))
        elif kind == GLOBAL:
            crossing.append("probe")
        state.record(kind, 0.01, 0.01)
        if state.is_window_end(step) and step == 15:
            state.decision = state.decision._replace(mode=GROUP, step=15)
    assert crossing == [False, False, False, True, False, False, False, "probe"] * 2


def test_simulator_replays_a_changing_network(tmp_path):
    from hvd_dssync.__main__ import main
    from hvd_dssync.simulate import parse_rate_changes, replay_adaptive

    changes = parse_rate_changes("t=30:inter=2,t=80:inter=40")
    out = replay_adaptive(world_size=16, steps=512, cross_rack_gbps=40, rate_changes=changes,
                          policy=AdaptivePolicy(decide_every=16))
    switches = [(d["step"], d["mode"]) for d in out["decisions"] if d["reason"] != "unchanged"]
    # The first window (two averages, every 8 steps) finds the network fast; t = 30 s falls inside the
    # window 80-95, whose early checks switch before its end.
    assert switches == [(15, GLOBAL), (94, GROUP), (255, GLOBAL)]
    assert out["seconds"]["adaptive"] < out["seconds"]["global"]
    at_ends = replay_adaptive(world_size=16, steps=512, cross_rack_gbps=40, rate_changes=changes,
                              policy=AdaptivePolicy(decide_every=16, switch_early=False))
    # Deciding at windows' ends only: at the end of the window the link slowed in (its last two global
    # averages were slow, though its first were fast).
    assert [(d["step"], d["mode"]) for d in at_ends["decisions"] if d["reason"] != "unchanged"][1] == (95, GROUP)
    assert out["seconds"]["adaptive"] < at_ends["seconds"]["adaptive"]
    timetable = tmp_path / "rates.json"
    timetable.write_text('[{"t": 80, "inter": 40}, {"t": 30, "inter": 2}]')
    assert parse_rate_changes(str(timetable)) == changes
    for bad in ("t=1", "inter=4", "t=1:inter=0", "t=1:wan=3", "t=a:inter=1"):
        with pytest.raises(ValueError, match="Arg ``rate_changes``"):
            parse_rate_changes(bad)
    assert main(["simulate", "--adaptive", "--workers", "16", "--steps", "64", "--decide-every", "16",
                 "--rate-change", "t=5:inter=0.5"]) == 0


@pytest.mark.multirank
@pytest.mark.parametrize("framework", ["torch", "torch-exchange", "keras"])
def test_every_rank_switches_at_the_same_step(framework):
    """Global averages slowed by one rank for 32 steps: groups at the same step everywhere, and back."""
    output = run("gloo", 4, "adaptive.py", *framework.split("-"), timeout=300)
    assert output.count("all checks passed") == 4, output
    if framework.startswith("torch"):
        assert output.count("resumed alike") == 4, output
