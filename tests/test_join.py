"""hvd_dssync.join: ranks that ran out of data agree, through their averages alone, on when all leave."""
import numpy as np
import pytest

from hvd_dssync.join import JoinState, everyone_knows_at
from hvd_dssync.plan import SyncPlan
from hvd_dssync.topology import Topology


def simulate(plan_of, world_size, joins, steps):
    """Every rank's JoinState through ``steps`` steps: averages of the payloads inside each step's groups,
    as the adapters' collectives compute them; ``joins`` is ``{rank: step}``. Returns ``{rank: step at which
    it would leave}`` (the first step after whose average it knows every join and has reached the leave step)."""
    states = [JoinState(world_size) for _ in range(world_size)]
    left = {}
    for step in range(steps):
        for rank, joined in joins.items():
            if joined == step:
                states[rank].note_joined(rank, step)
        for group in plan_of(0).partition(step):
            averaged = np.mean([states[r].payload() for r in group], axis=0)
            for r in group:
                states[r].merge(averaged)
        for rank, state in enumerate(states):
            leave = state.leave_step(plan_of(rank).partition)
            if rank not in left and leave is not None and step >= leave:
                left[rank] = step
    return left, states


@pytest.mark.parametrize("arguments", [
    dict(schedule="shuffle", seed=3),
    dict(schedule="shuffle", num_groups=2, seed=1, average_every=3, global_every=7),
    dict(schedule="butterfly", warmup_steps=4),
    dict(schedule="topology", topology=Topology.from_racks([[0, 1, 2], [3, 4, 5], [6, 7]]), average_every=2),
], ids=["shuffle", "local-steps-and-global", "butterfly-warmup", "topology-local-steps"])
@pytest.mark.parametrize("seed", range(4))
def test_every_rank_leaves_at_the_same_step_knowing_every_join(arguments, seed):
    world = 8
    plans = [SyncPlan(rank, world, **arguments) for rank in range(world)]
    rng = np.random.default_rng(seed)
    joins = {rank: int(rng.integers(0, 40)) for rank in range(world)}
    left, states = simulate(lambda r: plans[r], world, joins, steps=400)
    assert sorted(left) == list(range(world)), f"ranks that never left: {sorted(set(range(world)) - set(left))}"
    assert len(set(left.values())) == 1, f"ranks leave at different steps: {left}"
    (leave,) = set(left.values())
    assert leave == everyone_knows_at(plans[0].partition, joins, world) >= max(joins.values())
    for state in states:
        assert state.joined_steps() == joins
        assert state.last_to_join() == max(r for r, s in joins.items() if s == max(joins.values()))


def test_no_rank_knows_every_join_before_the_leave_step():
    """The leave step is the earliest at which it can be known: the bound is tight, not merely safe."""
    pairs = lambda step: ((0, 1), (2, 3)) if step % 2 == 0 else ((0, 2), (1, 3))  # noqa: E731
    joins = {0: 4, 1: 4, 2: 5, 3: 4}
    assert everyone_knows_at(pairs, joins, 4) == 6
    states = [JoinState(4) for _ in range(4)]
    for step in range(6):
        for rank, joined in joins.items():
            if joined == step:
                states[rank].note_joined(rank, step)
        for group in pairs(step):
            averaged = np.mean([states[r].payload() for r in group], axis=0)
            for r in group:
                states[r].merge(averaged)
    assert not all(state.everyone_joined() for state in states)


def test_join_steps_survive_float32_averages():
    state, other = JoinState(3), JoinState(3)
    state.note_joined(2, 1_000_003)
    averaged = ((state.payload().astype(np.float32) + other.payload().astype(np.float32)
                 + other.payload().astype(np.float32)) / np.float32(3)).astype(np.float32)
    other.merge(averaged)
    assert other.joined_steps() == {2: 1_000_003}


def test_groups_that_never_connect_every_rank_are_refused():
    racks = lambda step: ((0, 1), (2, 3))  # noqa: E731
    with pytest.raises(RuntimeError, match="did not connect every rank"):
        everyone_knows_at(racks, {0: 0, 1: 0, 2: 1, 3: 1}, 4, max_steps=50)


def test_reset_forgets_every_join():
    state = JoinState(2)
    state.note_joined(0, 3)
    state.reset()
    assert state.joined_steps() == {} and state.leave_step(lambda step: ((0, 1),)) is None
