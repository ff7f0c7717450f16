"""Property tests of the schedules: partitions, sizes, determinism, mixing, slow-link limits."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hvd_dssync.plan import SyncPlan, resolve_schedule
from hvd_dssync.schedules import Butterfly, Shuffle, TopologyAware, UserSchedule, make_schedule
from hvd_dssync.schedules.shuffle import _connects
from hvd_dssync.simulate import consensus_error
from hvd_dssync.topology import Topology

ROOT = __file__.rsplit("/tests/", 1)[0]


def assert_covers_once(groups, world_size):
    """Independent of the library's own validate_partition: every rank exactly once, no empty group."""
    flat = [r for g in groups for r in g]
    assert all(len(g) > 0 for g in groups), groups
    assert sorted(flat) == list(range(world_size)), groups


def sample_steps(schedule, windows=3):
    """A few steps in each of the first windows, including each window's first and last step."""
    if schedule.window_steps is None:
        return list(range(6))
    w = schedule.window_steps
    return sorted({s for k in range(windows) for s in (k * w, k * w + 1, (k + 1) * w - 1)})


shuffles = st.integers(1, 80).flatmap(lambda n: st.builds(
    Shuffle, st.just(n), num_groups=st.integers(1, n), seed=st.integers(0, 2**32),
    partitions_per_window=st.integers(1, 3), window_steps=st.none() | st.integers(1, 7)))

shuffles_by_size = st.integers(1, 80).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(1, n), st.integers(0, 2**20)))


@settings(max_examples=60, deadline=None)
@given(shuffles)
def test_shuffle_partitions_cover_every_rank_once(schedule):
    for step in sample_steps(schedule):
        groups = schedule.groups(step)
        assert_covers_once(groups, schedule.world_size)
        assert len(groups) == schedule.num_groups


@settings(max_examples=60, deadline=None)
@given(shuffles)
def test_shuffle_group_sizes_differ_by_at_most_one(schedule):
    for step in sample_steps(schedule):
        sizes = [len(g) for g in schedule.groups(step)]
        assert max(sizes) - min(sizes) <= 1, sizes


@settings(max_examples=60, deadline=None)
@given(shuffles_by_size)
def test_shuffle_group_size_bounds_the_largest_group(args):
    n, group_size, seed = args
    schedule = Shuffle(n, group_size=group_size, seed=seed)
    assert schedule.num_groups == math.ceil(n / group_size)
    for step in (0, 1, 200):
        assert_covers_once(schedule.groups(step), n)
        assert max(len(g) for g in schedule.groups(step)) <= group_size


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(2, 9))
def test_butterfly_partitions_cover_every_rank_once(n, group_size):
    schedule = Butterfly(n, group_size=group_size)
    for step in range(2 * schedule.steps_to_consensus + 1):
        assert_covers_once(schedule.groups(step), n)


racks_strategy = st.lists(st.integers(1, 6), min_size=1, max_size=6)


def topology_from_sizes(sizes):
    racks, start = [], 0
    for size in sizes:
        racks.append(list(range(start, start + size)))
        start += size
    return Topology.from_racks(racks)


@settings(max_examples=40, deadline=None)
@given(racks_strategy, st.integers(0, 4), st.integers(1, 3), st.integers(1, 4))
def test_topology_aware_covers_and_never_exceeds_max_cross_groups(sizes, intra_steps, max_cross, rotate):
    topology = topology_from_sizes(sizes)
    schedule = TopologyAware(topology, intra_steps=intra_steps, max_cross_groups=max_cross, rotate_every=rotate)
    for step in range(3 * schedule.window_steps + 2):
        groups = schedule.groups(step)
        assert_covers_once(groups, topology.world_size)
        crossing = {}
        for group in groups:
            racks = sorted({topology.rack_of(r) for r in group})
            for i, a in enumerate(racks):
                for b in racks[i + 1:]:
                    crossing[a, b] = crossing.get((a, b), 0) + 1
        assert all(count <= max_cross for count in crossing.values()), (step, groups)


@settings(max_examples=40, deadline=None)
@given(racks_strategy, st.integers(0, 2), st.integers(1, 3))
def test_topology_aware_windows_repeat_and_every_group_holds_them_all(sizes, intra_steps, max_cross):
    schedule = TopologyAware(topology_from_sizes(sizes), intra_steps=intra_steps, max_cross_groups=max_cross,
                             rotate_every=1)
    cycle = schedule.windows_repeat()
    assert all(schedule.partitions(w + cycle) == schedule.partitions(w) for w in range(2 * cycle))
    seen = {g for w in range(3 * cycle) for g in schedule.window_groups(w)}
    assert set(schedule.every_group()) == seen
    endless = TopologyAware(topology_from_sizes(sizes), rotate_every=None)
    assert endless.windows_repeat() == 1 and endless.every_group() == endless.window_groups(0)


def test_windows_drawn_afresh_never_repeat():
    assert Shuffle(8, num_groups=2, seed=0, window_steps=4).every_group() is None
    assert Shuffle(8, num_groups=2, seed=0).every_group() == Shuffle(8, num_groups=2, seed=0).window_groups(0)


def test_topology_aware_bridges_every_rack_pair_within_a_period():
    topology = topology_from_sizes([3, 2, 4])
    schedule = TopologyAware(topology, intra_steps=2)
    bridge = schedule.groups(2)
    assert any(len({topology.rack_of(r) for r in g}) == 3 for g in bridge), bridge
    assert all(len({topology.rack_of(r) for r in g}) == 1 for g in schedule.groups(0))



def _bridge_then_rack(schedule, step, agreed, now=None):
    """Two steps of averaging as the adapters do them around an exact bridge at ``step``: ``agreed`` are the
    models right after the last average, ``now`` the current ones (``agreed`` plus local steps). A bridge rank
    sends its agreed model times its scale and adds the move to its own; the others send their models."""
    now = agreed if now is None else now
    n = schedule.world_size
    bridges = [schedule.bridge(r, step) for r in range(n)]
    sent = np.array([now[r] if b is None else agreed[r] * b.scale for r, b in enumerate(bridges)])
    averaged = sent.copy()
    for group in schedule.groups(step):
        averaged[list(group)] = sent[list(group)].mean(axis=0)
    moves = np.array([np.zeros_like(now[r]) if b is None else averaged[r] - agreed[r] for r, b in enumerate(bridges)])
    after = np.array([averaged[r] if b is None else now[r] + moves[r] for r, b in enumerate(bridges)])
    carry = np.array([moves[r] * (b.carry if b else 0.0) for r, b in enumerate(bridges)])
    final = np.empty_like(now)
    for group in schedule.groups(step + 1):
        final[list(group)] = (after[list(group)] + carry[list(group)]).mean(axis=0)
    return final


@settings(max_examples=60, deadline=None)
@given(racks_strategy, st.integers(1, 3), st.integers(1, 3), st.sampled_from([None, 1, 2]))
def test_exact_bridges_keep_the_mean_and_reach_it_where_every_bridge_spans_every_rack(sizes, intra_steps, max_cross,
                                                                                      rotate):
    """From racks that each agreed on a model at their last average, the exact bridge and the racks' next
    average move every rack to the average of all ranks' agreed models, whatever the racks' sizes (the bridge
    weighs each rack by its ranks), and each rack keeps its ranks' local steps since: nothing is lost. Where a
    small rack sits out some bridge group the mean is still kept."""
    topology = topology_from_sizes(sizes)
    schedule = TopologyAware(topology, intra_steps=intra_steps, max_cross_groups=max_cross, rotate_every=rotate)
    n = topology.world_size
    rng = np.random.default_rng(len(sizes) * 100 + intra_steps)
    rack_models = rng.standard_normal((len(sizes), 3))
    agreed = np.array([rack_models[topology.rack_of(r)] for r in range(n)])
    local = rng.standard_normal((n, 3))  # each rank's local steps since the last average
    step = intra_steps + (intra_steps + 1)  # the second bridge step
    assert any(schedule.crosses(g) for g in schedule.groups(step)) or len(sizes) == 1
    final = _bridge_then_rack(schedule, step, agreed, agreed + local)
    assert np.allclose(final.mean(axis=0), (agreed + local).mean(axis=0))
    if len(sizes) > 1 and min(sizes) >= max_cross:
        kept = np.array([local[list(topology.rack_ranks()[topology.rack_of(r)])].mean(axis=0) for r in range(n)])
        assert np.allclose(final, agreed.mean(axis=0) + kept), (sizes, schedule.groups(step))


def test_plain_bridges_take_in_a_rack_size_share():
    plain = TopologyAware(topology_from_sizes([4, 4]), intra_steps=1, exact_bridges=False)
    assert plain.bridge(0, 1) is None and plain.config()["exact_bridges"] is False and not plain.has_bridges
    x = np.array([[0.0]] * 4 + [[8.0]] * 4)
    assert _bridge_then_rack(plain, 1, x)[0, 0] == 1.0  # a quarter of the way to the mean, 4
    exact = TopologyAware(topology_from_sizes([4, 4]), intra_steps=1)
    assert exact.has_bridges and np.allclose(_bridge_then_rack(exact, 1, x), 4.0)
    with pytest.raises(TypeError, match="exact_bridges"):
        TopologyAware(topology_from_sizes([2, 2]), exact_bridges=1)


def _through_the_racks(schedule, step, x):
    """What every rank holds after a global average through the racks (``schedule.global_route``), done as
    the PyTorch adapter does it: the rack's mean, the speakers' average of their scaled rack means (every
    other rank averages nothing that is kept), each rack's sum of its speaker's result and zeros."""
    n = len(x)
    routes = [schedule.global_route(r, step) for r in range(n)]
    held = np.array([x[list(route.rack)].mean(axis=0) for route in routes])
    for group in {route.group for route in routes if route.speaks}:
        mean = np.mean([held[r] * routes[r].scale for r in group], axis=0)
        held[list(group)] = mean
    spoken = np.array([held[r] if routes[r].speaks else np.zeros_like(held[r]) for r in range(n)])
    return np.array([spoken[list(route.rack)].sum(axis=0) for route in routes])


@settings(max_examples=60, deadline=None)
@given(racks_strategy.filter(lambda sizes: len(sizes) > 1), st.integers(1, 3), st.integers(1, 3),
       st.sampled_from([None, 1, 2]), st.integers(0, 20))
def test_a_global_average_through_the_racks_gives_every_rank_the_mean(sizes, intra_steps, max_cross, rotate, step):
    """Whatever the racks' sizes, the bridges' count and rotation and the step: one speaker in each rack, its
    group one the schedule has at its bridge step, and every rank ends with the mean of all models."""
    topology = topology_from_sizes(sizes)
    schedule = TopologyAware(topology, intra_steps=intra_steps, max_cross_groups=max_cross, rotate_every=rotate,
                             global_via_bridges=True)
    n = topology.world_size
    routes = [schedule.global_route(r, step) for r in range(n)]
    window = schedule.window_groups(schedule.window_of(step))
    assert all(route.rack in window and route.group in window for route in routes)
    for rack in topology.rack_ranks():
        assert sum(routes[r].speaks for r in rack) == 1, routes
    x = np.random.default_rng(sum(sizes) + step).standard_normal((n, 3))
    assert np.allclose(_through_the_racks(schedule, step, x), x.mean(axis=0)), (sizes, routes)


def test_global_averages_go_through_the_racks_only_where_asked_and_where_there_are_racks():
    assert TopologyAware(topology_from_sizes([2, 2])).global_route(0, 0) is None
    assert TopologyAware(topology_from_sizes([4]), global_via_bridges=True).global_route(0, 0) is None
    routed = TopologyAware(topology_from_sizes([2, 2]), global_via_bridges=True)
    assert routed.config()["global_via_bridges"] is True
    assert "global_via_bridges" not in TopologyAware(topology_from_sizes([2, 2])).config()  # old checkpoints
    x = np.array([[0.0], [1.0], [2.0], [7.0]])
    assert np.array_equal(_through_the_racks(routed, 0, x), np.full((4, 1), 2.5))  # exact, racks of one size
    auto = TopologyAware(topology_from_sizes([2, 2]), global_via_bridges="auto")
    assert auto.config()["global_via_bridges"] == "auto" and auto.global_route(0, 0) == routed.global_route(0, 0)
    for wrong in (1, "yes"):
        with pytest.raises(TypeError, match="global_via_bridges"):
            TopologyAware(topology_from_sizes([2, 2]), global_via_bridges=wrong)


def test_topology_aware_fixed_bridges_need_steps_inside_the_racks():
    """With intra_steps=0 fixed bridges would keep a rack's other ranks apart from them: refused, naming the
    argument; rotating bridges, or racks of one rank each (one bridge group of everyone), are fine."""
    with pytest.raises(ValueError, match="``rotate_every``: fixed bridges"):
        TopologyAware(topology_from_sizes([2, 2]), intra_steps=0)
    assert TopologyAware(topology_from_sizes([2, 2]), intra_steps=0, rotate_every=1).groups(0)
    assert TopologyAware(topology_from_sizes([1, 1, 1]), intra_steps=0).groups(0) == ((0, 1, 2),)

SUBPROCESS_CASES = [
    "Shuffle(10, num_groups=3, seed=7, window_steps=5)",
    "Shuffle(33, group_size=4, seed=123456789)",
    "Butterfly(24, group_size=3)",
    "TopologyAware(Topology.from_racks([[0, 1, 2], [3, 4], [5, 6, 7]]), intra_steps=1, rotate_every=2)",
]


@pytest.mark.parametrize("expression", SUBPROCESS_CASES, ids=lambda e: e.split("(")[0])
def test_same_arguments_same_partitions_in_another_process(expression):
    steps = list(range(0, 40)) + [199, 200, 401, 1234]
    code = ("import json; from hvd_dssync.schedules import *; from hvd_dssync.topology import Topology; "
            f"s = {expression}; print(json.dumps([s.groups(t) for t in {steps}]))")
    # A different hash seed would expose any dependence on set or dict iteration order.
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, timeout=120).stdout
    here = eval(expression, {"Shuffle": Shuffle, "Butterfly": Butterfly, "TopologyAware": TopologyAware,
                             "Topology": Topology})
    assert json.loads(out) == json.loads(json.dumps([here.groups(t) for t in steps]))


@settings(max_examples=40, deadline=None)
@given(st.integers(6, 40), st.integers(0, 2**31), st.integers(1, 2**31))
def test_another_seed_gives_another_sequence(n, seed, delta):
    num_groups = max(2, n // 3)
    a = Shuffle(n, num_groups=num_groups, seed=seed, window_steps=1)
    b = Shuffle(n, num_groups=num_groups, seed=seed + delta, window_steps=1)
    assert [a.groups(t) for t in range(20)] != [b.groups(t) for t in range(20)]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 64).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(1, max(1, n // 2)), st.integers(0, 2**32), st.integers(2, 3))))
def test_every_shuffle_window_connects_all_ranks(args):
    n, num_groups, seed, per_window = args
    # Groups of two or more; sizes with mostly singleton groups are best effort (see the docstring).
    schedule = Shuffle(n, num_groups=num_groups, seed=seed, partitions_per_window=per_window, window_steps=3)
    for window in range(4):
        assert _connects(schedule.partitions(window)), schedule.partitions(window)


def test_shuffle_says_so_when_a_window_cannot_connect():
    # 2 partitions of 7 ranks in 5 groups add at most 4 links; 6 are needed.
    with pytest.warns(UserWarning, match="cannot connect all ranks within a window"):
        Shuffle(7, num_groups=5, seed=0)


@pytest.mark.parametrize("n,num_groups", [(4096, 2048), (4096, 1024), (1000, 499), (64, 32)])
def test_large_shuffle_windows_connect_all_ranks(n, num_groups):
    schedule = Shuffle(n, num_groups=num_groups, seed=5)
    for window in range(3):
        assert _connects(schedule.partitions(window))


@pytest.mark.parametrize("n,group_size", [(2, 2), (4, 2), (8, 2), (64, 2), (64, 4), (6, 2), (12, 3),
                                          (30, 4), (27, 3), (100, 5), (7, 2)])
def test_butterfly_reaches_exact_consensus_after_steps_to_consensus(n, group_size):
    schedule = Butterfly(n, group_size=group_size)
    k = schedule.steps_to_consensus
    errors = consensus_error(schedule, 2 * k, dim=4, seed=1)
    assert errors[k - 1] < 1e-12
    if k > 1:
        assert errors[k - 2] > 1e-3
    # Any k consecutive steps, not only the first k.
    assert consensus_error(schedule, k, dim=4, seed=2, start=1)[-1] < 1e-12


def test_butterfly_four_workers_matches_the_authors_code():
    assert [Butterfly(4).groups(t) for t in range(3)] == [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 1), (2, 3))]


class Alternating:
    """The DS-Sync authors' 4-worker schedule, as a user object."""
    world_size = 4

    def groups(self, step):
        return [[0, 1], [2, 3]] if step % 2 == 0 else [[0, 3], [1, 2]]


def test_user_schedule_accepts_a_valid_schedule():
    schedule = UserSchedule(Alternating(), 4)
    assert schedule.groups(0) == ((0, 1), (2, 3))
    assert schedule.groups(101) == ((0, 3), (1, 2))


class Broken:
    def __init__(self, world_size, partition):
        self.world_size, self.partition = world_size, partition

    def groups(self, step):
        return self.partition


@pytest.mark.parametrize("partition,message", [
    ([[0, 1], [2]], r"leaves ranks \[3\] out"),
    ([[0, 1], [1, 2, 3]], "puts rank 1 in more than one group"),
    ([[0, 1], [2, 3, 4]], "names rank 4, outside 0..3"),
    ([[0, 1, 2, 3], []], "empty group"),
])
def test_user_schedule_rejects_partitions_that_do_not_cover(partition, message):
    with pytest.raises(ValueError, match=message):
        UserSchedule(Broken(4, partition), 4)


class Flaky:
    world_size = 4

    def __init__(self):
        self.calls = 0

    def groups(self, step):
        self.calls += 1
        return [[0, 1], [2, 3]] if self.calls % 2 else [[0, 2], [1, 3]]


def test_user_schedule_rejects_a_non_deterministic_schedule():
    with pytest.raises(ValueError, match="different partitions when called twice"):
        UserSchedule(Flaky(), 4)


def test_user_schedule_rejects_the_wrong_world_size():
    with pytest.raises(ValueError, match="world size 4, but the job has 8 ranks"):
        UserSchedule(Alternating(), 8)


def test_user_schedule_rejects_an_object_without_groups():
    with pytest.raises(TypeError, match="groups"):
        UserSchedule(object(), 4)


class Aperiodic:
    world_size = 2

    def groups(self, step):
        return [[0, 1]] if step == 63 else [[0], [1]]


def test_user_schedule_without_window_must_repeat():
    with pytest.raises(ValueError, match="must repeat"):
        UserSchedule(Aperiodic(), 2)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(schedule="shuffle", num_groups=2, group_size=2), ValueError, "exactly one of ``num_groups`` and ``group_size``"),
    (dict(schedule="shuffle"), ValueError, "exactly one of ``num_groups`` and ``group_size``"),
    (dict(schedule="shuffle", num_groups=9), ValueError, "``num_groups`` must be at most the world size 8"),
    (dict(schedule="shuffle", group_size=9), ValueError, "``group_size`` must be at most the world size 8"),
    (dict(schedule="shuffle", num_groups=0), ValueError, "``num_groups`` must be at least 1"),
    (dict(schedule="shuffle", num_groups=2, seed=1.5), TypeError, "``seed`` must be an integer"),
    (dict(schedule="shuffle", num_groups=2, seed="0"), TypeError, "``seed`` must be an integer"),
    (dict(schedule="shuffle", num_groups=2, seed=True), TypeError, "``seed`` must be an integer"),
    (dict(schedule="ring", num_groups=2), ValueError, "must be one of"),
    (dict(schedule="butterfly", num_groups=2), ValueError, "``num_groups`` does not apply"),
    (dict(schedule="topology"), ValueError, "needs a topology"),
    (dict(schedule=Butterfly(4)), ValueError, "world size 4, but the job has 8"),
])
def test_make_schedule_errors_name_the_problem(kwargs, error, message):
    with pytest.raises(error, match=message):
        make_schedule(world_size=8, **kwargs)


def test_make_schedule_builds_each_named_schedule():
    assert isinstance(make_schedule("shuffle", 8, num_groups=2), Shuffle)
    assert isinstance(make_schedule("butterfly", 8), Butterfly)
    topology = Topology.from_racks([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert isinstance(make_schedule("topology", 8, topology=topology), TopologyAware)
    assert isinstance(make_schedule(Alternating(), 4), UserSchedule)


def test_groups_in_and_window_groups_agree_with_groups():
    schedule = Shuffle(12, num_groups=3, seed=5, window_steps=4)
    direct = {g for t in range(3, 11) for g in schedule.groups(t)}
    assert set(schedule.groups_in(3, 11)) == direct
    assert set(schedule.window_groups(1)) == {g for t in range(4, 8) for g in schedule.groups(t)}


class PeriodThree:
    """A period that does not divide the 64-step scan of an endless user schedule."""
    world_size = 3

    def groups(self, step):
        return [[step % 3], [(step + 1) % 3, (step + 2) % 3]]


def test_endless_user_schedule_repeats_with_its_own_period():
    schedule, user = UserSchedule(PeriodThree(), 3), PeriodThree()
    for step in range(300):
        assert schedule.groups(step) == tuple(sorted(tuple(sorted(g)) for g in user.groups(step))), step


@pytest.mark.parametrize("world_size,groups", [(2, 1), (3, 1), (4, 2), (6, 2), (7, 2), (8, 2), (16, 4), (64, 16)])
def test_default_schedule_without_arguments(world_size, groups):
    """No DS-Sync argument at all (the one-line swap): random groups sized from the world."""
    plan = SyncPlan(0, world_size)
    assert plan.schedule.config()["name"] == "shuffle"
    assert plan.schedule.num_groups == groups


def test_default_schedule_follows_known_racks(monkeypatch):
    monkeypatch.delenv("HVD_DSSYNC_TOPOLOGY", raising=False)
    assert SyncPlan(0, 4, schedule=None, topology=Topology.from_racks([[0, 1], [2, 3]])).schedule.config()["name"] == "topology"
    monkeypatch.setenv("HVD_DSSYNC_TOPOLOGY", '{"racks": [[0, 1], [2, 3]]}')
    assert resolve_schedule(None, None, None, None)[0] == "topology"


@pytest.mark.parametrize("arguments,named", [({"num_groups": 3}, "num_groups"), ({"group_size": 2}, "group_size")])
def test_group_sizes_are_refused_under_the_topology_aware_schedule(monkeypatch, arguments, named):
    """num_groups and group_size have nothing to set in the topology-aware schedule: refused, not dropped."""
    monkeypatch.delenv("HVD_DSSYNC_TOPOLOGY", raising=False)
    racks = Topology.from_racks([[0, 1], [2, 3]])
    for schedule, topology in (("topology", racks), (None, racks)):
        with pytest.raises(ValueError, match=f"``{named}`` does not apply to .*racks and their bridges"):
            SyncPlan(0, 4, schedule=schedule, topology=topology, **arguments)
    with pytest.raises(ValueError, match=f"``{named}``.*topology-aware since ``topology`` is given"):
        resolve_schedule(None, arguments.get("num_groups"), arguments.get("group_size"), [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=f"``{named}`` does not apply to schedule='topology'"):
        make_schedule("topology", 4, topology=racks, **arguments)
    monkeypatch.setenv("HVD_DSSYNC_TOPOLOGY", '{"racks": [[0, 1], [2, 3]]}')
    with pytest.raises(ValueError, match=f"``{named}``.*since HVD_DSSYNC_TOPOLOGY is set"):
        resolve_schedule(None, arguments.get("num_groups"), arguments.get("group_size"), None)
    # the same arguments with a schedule that has sizes are as before; the racks alone still choose "topology"
    assert resolve_schedule("shuffle", arguments.get("num_groups"), arguments.get("group_size"), None)[0] == "shuffle"
    assert SyncPlan(0, 4, schedule=None, topology=racks).schedule.config()["name"] == "topology"


def test_local_steps_use_every_partition():
    """Averaging every 2nd step with a 2-partition schedule still alternates the partitions."""
    plan = SyncPlan(0, 4, num_groups=2, seed=0, average_every=2)
    groups = [plan.action(t).group for t in range(8) if plan.action(t).kind == "group"]
    assert len(set(groups)) == 2 and groups[0] != groups[1]
    assert plan.action(0) == ("local", (0,))


def test_racks_with_no_bridge_step_meet_in_global_averages_through_their_bridges():
    """intra_steps=None: every average inside the racks, one partition a cycle, no exact-bridge copies; the
    bridge step's groups are still registered where global averages go through them, and a plan without
    global averages is refused (its racks would never meet), as are rotating bridges."""
    topology = topology_from_sizes([3, 3])
    schedule = TopologyAware(topology, intra_steps=None, global_via_bridges=True)
    assert schedule.groups(0) == schedule.groups(5) == ((0, 1, 2), (3, 4, 5)) and schedule.cycle == 1
    assert not schedule.has_bridges and schedule.bridge(2, 0) is None
    assert set(schedule.every_group()) == {(0, 1, 2), (3, 4, 5), (2, 5), (0, 1), (3, 4)}
    assert schedule.global_route(5, 9).group == (2, 5)
    assert TopologyAware(topology, intra_steps=None).every_group() == ((0, 1, 2), (3, 4, 5))
    with pytest.raises(ValueError, match="rotate_every"):
        TopologyAware(topology, intra_steps=None, rotate_every=2)
    racks = [[0, 1, 2], [3, 4, 5]]
    options = {"intra_steps": None, "global_via_bridges": True}
    plan = SyncPlan(0, 6, schedule="topology", topology=racks, average_every=8, global_every=32, schedule_options=options)
    assert [t for t in range(64) if plan.action(t).kind != "local"] == [7, 15, 23, 31, 39, 47, 55, 63]
    assert [t for t in range(64) if plan.global_route(t)] == [31, 63]
    with pytest.raises(ValueError, match="``global_every`` is 0"):
        SyncPlan(0, 6, schedule="topology", topology=racks, average_every=8, schedule_options=options)
