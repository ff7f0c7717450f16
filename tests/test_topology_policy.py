"""Topology parsing and the synchronization policy."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from hvd_dssync.policy import BSP, GLOBAL, GROUP, LOCAL, Policy
from hvd_dssync.topology import ENV_VAR, Topology


def test_parse_racks_of_ranks():
    t = Topology.parse([[0, 1], [2, 3, 4]])
    assert t.rack_ranks() == [[0, 1], [2, 3, 4]]
    assert t.world_size == 5 and t.num_racks == 2
    assert t.is_slow(1, 2) and not t.is_slow(2, 4)


def test_parse_dict_with_rates():
    t = Topology.parse({"racks": [[0, 2], [1, 3]], "intra_rack_gbps": 25, "cross_rack_gbps": 2.5})
    assert t.rack_ranks() == [[0, 2], [1, 3]]
    assert (t.intra_rack_gbps, t.cross_rack_gbps) == (25.0, 2.5)
    assert t.is_slow(0, 1) and not t.is_slow(0, 2)


def test_parse_racks_of_hostnames_needs_and_uses_rank_hosts():
    spec = {"racks": [["a", "b"], ["c"]]}
    t = Topology.parse(spec, rank_hosts=["a", "a", "b", "c", "c"])
    assert t.rack_ranks() == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="needs the job's hosts"):
        Topology.parse(spec)


def test_host_not_named_gets_a_rack_of_its_own():
    t = Topology.parse({"racks": [["a"]]}, rank_hosts=["a", "b", "b"])
    assert t.rack_ranks() == [[0], [1, 2]]


def test_parse_json_string_and_file(tmp_path):
    spec = {"racks": [[0], [1]], "cross_rack_gbps": 0.5}
    assert Topology.parse(json.dumps(spec)).cross_rack_gbps == 0.5
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(spec))
    assert Topology.parse(str(path)) == Topology.parse(spec)


def test_parse_returns_a_topology_unchanged():
    t = Topology.from_racks([[0], [1]])
    assert Topology.parse(t) is t


@pytest.mark.parametrize("spec,rank_hosts,message", [
    ("not json {", None, "neither a file nor valid JSON"),
    ({"rack": [[0, 1]]}, None, "must be a list of racks or a dict with 'racks'"),
    (42, None, "must be a list of racks"),
    ({"racks": [[0, 1]], "speed": 3}, None, r"unknown keys \['speed'\]"),
    ([[0, 1], [1, 2]], None, "exactly once"),
    ([[0, 2]], None, "exactly once"),
    ([[0, 1]], ["h0", "h1", "h2"], "names 2 ranks, but the job has 3"),
    ({"racks": [["a"], ["a"]]}, ["a"], "more than one rack"),
    ({"racks": [["a"], ["z"]]}, ["a"], r"hosts that run no rank: \['z'\]"),
    ({"racks": [[0], [1]], "cross_rack_gbps": 0}, None, "cross_rack_gbps`` must be a positive number"),
    ({"racks": [[0], [1]], "intra_rack_gbps": "fast"}, None, "intra_rack_gbps`` must be a positive number"),
])
def test_parse_errors_name_the_problem(spec, rank_hosts, message):
    with pytest.raises(ValueError, match=message):
        Topology.parse(spec, rank_hosts=rank_hosts)


def test_from_racks_rejects_ranks_that_are_not_integers():
    with pytest.raises(ValueError, match="integer ranks"):
        Topology.from_racks([[0, True]])


def test_empty_topology_is_rejected():
    with pytest.raises(ValueError, match="at least one rank"):
        Topology([])


def test_from_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert Topology.from_env(["a", "a", "b"]).rack_ranks() == [[0, 1], [2]]
    monkeypatch.setenv(ENV_VAR, json.dumps([[0, 2], [1]]))
    assert Topology.from_env(["a", "a", "b"]).rack_ranks() == [[0, 2], [1]]


@settings(max_examples=50, deadline=None)
@given(st.permutations(list(range(12))), st.lists(st.integers(1, 12), min_size=1, max_size=12))
def test_from_racks_round_trips_through_to_dict(ranks, cuts):
    racks, start = [], 0
    for size in cuts:
        if start < len(ranks):
            racks.append(sorted(ranks[start:start + size]))
            start += size
    if start < len(ranks):
        racks.append(sorted(ranks[start:]))
    t = Topology.from_racks(racks)
    assert t.rack_ranks() == sorted(racks)
    assert Topology.parse(t.to_dict()) == t
    for rack in racks:
        assert all(not t.is_slow(rack[0], r) for r in rack)


def test_policy_actions():
    policy = Policy(warmup_steps=3, global_every=4)
    actions = [policy.action(t) for t in range(12)]
    assert actions == [BSP] * 3 + [GROUP, GROUP, GROUP, GLOBAL, GROUP, GROUP, GROUP, GLOBAL, GROUP]


def test_policy_defaults_always_group():
    assert {Policy().action(t) for t in range(50)} == {GROUP}


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 20), st.integers(0, 10), st.integers(0, 200))
def test_policy_counts(warmup, every, steps):
    policy = Policy(warmup_steps=warmup, global_every=every)
    actions = [policy.action(t) for t in range(steps)]
    assert actions.count(BSP) == min(warmup, steps)
    after = max(0, steps - warmup)
    assert actions.count(GLOBAL) == (after // every if every else 0)


@pytest.mark.parametrize("kwargs,name", [
    (dict(warmup_steps=-1), "warmup_steps"), (dict(global_every=-2), "global_every"),
    (dict(warmup_steps=1.5), "warmup_steps"), (dict(global_every=True), "global_every"),
])
def test_policy_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"``{name}`` must be a non-negative integer"):
        Policy(**kwargs)


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_policy_rejects_bad_average_every(value):
    with pytest.raises(ValueError, match="``average_every`` must be a positive integer"):
        Policy(average_every=value)


def test_policy_config_round_trips():
    policy = Policy(warmup_steps=5, global_every=7, average_every=2)
    assert Policy(**policy.config()).config() == {"warmup_steps": 5, "global_every": 7, "average_every": 2}


def test_local_steps_as_pytorch_hierarchical_averager():
    """average_every=2, global_every=8: groups on steps 2, 4, 6 of each 8, all ranks on the 8th (1-based)."""
    policy = Policy(average_every=2, global_every=8)
    kinds = [policy.action(t) for t in range(16)]
    assert kinds == [LOCAL, GROUP, LOCAL, GROUP, LOCAL, GROUP, LOCAL, GLOBAL] * 2


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 6), st.integers(0, 9), st.integers(1, 6), st.integers(1, 120))
def test_schedule_advances_once_per_group_average(warmup, every, average_every, steps):
    """Every group average uses the schedule's next step; BSP steps use their own; nothing else moves it."""
    policy = Policy(warmup_steps=warmup, global_every=every, average_every=average_every)
    used = [policy.schedule_step(t) for t in range(warmup, warmup + steps) if policy.action(t) == GROUP]
    assert used == list(range(warmup, warmup + len(used)))
    assert [policy.schedule_step(t) for t in range(min(warmup, steps))] == list(range(min(warmup, steps)))
    kinds = [policy.action(t) for t in range(warmup, warmup + 3 * policy.period())]
    assert kinds[:policy.period()] == kinds[policy.period():2 * policy.period()]


def test_default_policy_is_unchanged_by_local_steps():
    policy = Policy(warmup_steps=2)
    assert [policy.schedule_step(t) for t in range(10)] == list(range(10))
