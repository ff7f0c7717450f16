"""hvd_dssync.plan without Horovod: the default schedule, each step's action, elastic arguments, agreement."""
import numpy as np
import pytest

from hvd_dssync.config import SyncConfig
from hvd_dssync.plan import (BSP, GLOBAL, GROUP, LOCAL, Action, SyncPlan, agreement_fields, agreement_payload,
                             arguments_for_world, check_agreement, resolve_schedule)
from hvd_dssync.topology import ENV_VAR, Topology


def test_resolve_schedule_defaults(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_schedule(None, None, None, None) == ("shuffle", None, None)
    assert resolve_schedule(None, 2, None, None) == ("shuffle", 2, None)
    assert resolve_schedule("butterfly", None, 2, None) == ("butterfly", None, 2)
    assert resolve_schedule(None, None, None, [[0, 1], [2, 3]]) == ("topology", None, None)
    monkeypatch.setenv(ENV_VAR, "[[0, 1], [2, 3]]")
    assert resolve_schedule(None, None, None, None) == ("topology", None, None)
    assert resolve_schedule("shuffle", 2, None, None) == ("shuffle", 2, None)  # asked for: the racks do not matter


def test_resolve_schedule_refuses_sizes_under_the_topology_aware_schedule(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "[[0, 1], [2, 3]]")
    with pytest.raises(ValueError, match="``num_groups`` does not apply .* HVD_DSSYNC_TOPOLOGY is set"):
        resolve_schedule(None, 3, None, None)
    with pytest.raises(ValueError, match="``group_size`` does not apply to schedule='topology'"):
        resolve_schedule("topology", None, 2, None)


def test_action_follows_warmup_policy_and_schedule():
    plan = SyncPlan(rank=1, world_size=4, schedule="butterfly", warmup_steps=1, global_every=3, average_every=1)
    assert plan.action(0) == Action(BSP, (0, 1, 2, 3))
    assert plan.action(1) == Action(GROUP, (1, 3))
    assert plan.action(2) == Action(GROUP, (0, 1))
    assert plan.action(3) == Action(GLOBAL, (0, 1, 2, 3))
    local = SyncPlan(rank=2, world_size=4, num_groups=2, average_every=2)
    assert local.action(0) == Action(LOCAL, (2,))
    assert local.action(1).kind == GROUP and 2 in local.action(1).group


def test_one_rank_and_default_sizes():
    assert SyncPlan(0, 1).action(0) == Action(GROUP, (0,))
    assert SyncPlan(0, 8).schedule.num_groups == 2  # groups of 4
    assert SyncPlan(0, 4, schedule=None, topology=Topology.from_racks([[0, 1], [2, 3]])).schedule.config()["name"] \
        == "topology"


def test_window_change_registers_once_per_window():
    plan = SyncPlan(0, 4, num_groups=2, schedule_options={"window_steps": 2})
    first = plan.window_change(0)
    assert first is not None and first[1] == ()
    assert plan.window_change(1) is None
    acquire, release = plan.window_change(2)
    assert release == first[0]


def test_from_config_equals_the_constructor():
    config = SyncConfig(num_groups=2, seed=5, warmup_steps=1, average_every=2, global_every=4)
    built = SyncPlan.from_config(3, 8, config)
    direct = SyncPlan(3, 8, num_groups=2, seed=5, warmup_steps=1, average_every=2, global_every=4)
    assert [built.action(t) for t in range(12)] == [direct.action(t) for t in range(12)]
    assert built.config() == direct.config()
    adaptive = SyncPlan.from_config(0, 4, SyncConfig(policy="adaptive"))
    assert adaptive.adaptive is not None and adaptive.config()["adaptive"]["decide_every"] == 64
    with pytest.raises(TypeError, match="``config`` must be a SyncConfig"):
        SyncPlan.from_config(0, 4, {"num_groups": 2})


def test_arguments_for_world_caps_sizes_and_refuses_fixed_ranks():
    assert arguments_for_world({"schedule": "shuffle", "num_groups": 4, "group_size": None}, 3) == \
        {"schedule": "shuffle", "num_groups": 3, "group_size": None}
    assert arguments_for_world({"schedule": None, "group_size": 2}, 8) == {"schedule": None, "group_size": 2}
    for arguments in ({"schedule": "topology"}, {"schedule": None, "topology": [[0], [1]]},
                      {"schedule": SyncPlan(0, 2).schedule}):
        with pytest.raises(RuntimeError, match="built for a fixed set of ranks"):
            arguments_for_world(arguments, 2)


def test_check_agreement_names_the_argument_and_the_ranks():
    same = [agreement_payload(agreement_fields(SyncPlan(r, 4, num_groups=2, seed=1), step=r)) for r in range(4)]
    ranks = check_agreement(np.concatenate(same))
    assert len(ranks) == 4 and [r["step"] for r in ranks] == [0, 1, 2, 3]  # the step is not compared
    differ = same[:3] + [agreement_payload(agreement_fields(SyncPlan(3, 4, num_groups=2, seed=2)))]
    with pytest.raises(ValueError, match=r"ranks disagree on seed \(rank 0 has 1, rank 3 has 2\)") as error:
        check_agreement(np.concatenate(differ))
    assert "groups (" not in str(error.value)  # the groups follow from the seed: not named besides it


def test_global_averages_through_the_racks_are_refused_where_they_cannot_be_honoured():
    from hvd_dssync.plan import routes_global_averages
    from hvd_dssync.schedules import TopologyAware
    from hvd_dssync.topology import Topology
    racks = Topology.from_racks([[0, 1], [2, 3]])
    routed, auto = TopologyAware(racks, global_via_bridges=True), TopologyAware(racks, global_via_bridges="auto")
    assert routes_global_averages(routed, "PyTorch") and routes_global_averages(auto, "PyTorch")
    assert not routes_global_averages(TopologyAware(racks), "Keras", lossy_compression=True, adaptive=True,
                                      sparse=True)  # not asked for: nothing to refuse
    for adapter, beside, words in (("Keras", {}, "the Keras adapter"),
                                   ("PyTorch", {"lossy_compression": True}, "a lossy compression"),
                                   ("PyTorch", {"adaptive": True}, 'policy="adaptive"'),
                                   ("PyTorch", {"sparse": True}, "sparse_average")):
        with pytest.raises(ValueError, match=f"global_via_bridges=True cannot be honoured with {words}"):
            routes_global_averages(routed, adapter, **beside)
        assert not routes_global_averages(auto, adapter, **beside)  # "auto": over every rank at once there
    # Beside overlap=True, "auto" goes over every rank at once, one op behind the steps; asked for, the route
    # is kept, waited for.
    assert routes_global_averages(routed, "PyTorch", overlapped=True)
    assert not routes_global_averages(auto, "PyTorch", overlapped=True)
