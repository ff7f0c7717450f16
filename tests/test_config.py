"""hvd_dssync.config.SyncConfig: one validated object for DS-Sync's own arguments."""
import json

import numpy as np
import pytest

from hvd_dssync.adaptive import AdaptivePolicy
from hvd_dssync.config import FLAT_AVERAGE_EVERY, RACK_AVERAGE_EVERY, RACK_GLOBAL_EVERY, SyncConfig, build_schedule, config_of
from hvd_dssync.plan import SyncPlan
from hvd_dssync.schedules import Butterfly
from hvd_dssync.topology import ENV_VAR, Topology


def test_defaults_are_the_adapters():
    config = SyncConfig()
    assert (config.num_groups, config.group_size, config.seed, config.schedule, config.topology) == \
        (None, None, 0, None, "auto")
    assert (config.warmup_steps, config.global_every, config.average_every, config.policy) == (0, None, None, None)
    assert (config.outer_momentum, config.overlap, config.average_buffers, config.sparse_average) == \
        (0.0, None, True, True)


# What each adapter's DistributedOptimizer passes to config_of when the user gives no DS-Sync argument.
TORCH_DEFAULTS = dict(num_groups=None, group_size=None, seed=0, schedule=None, topology="auto", warmup_steps=0,
                      global_every=None, average_every=None, schedule_options=None, policy=None, outer_momentum=0.0,
                      overlap=None, average_buffers=True, sparse_average=True)
KERAS_DEFAULTS = {k: v for k, v in TORCH_DEFAULTS.items() if k != "outer_momentum"}


def test_one_object_serves_both_adapters_and_refuses_a_second_value():
    sync = SyncConfig(num_groups=2, seed=7, average_every=2)
    assert config_of(sync, TORCH_DEFAULTS) is sync
    assert config_of(sync, KERAS_DEFAULTS, unsupported=("outer_momentum",)) is sync
    assert config_of(None, dict(TORCH_DEFAULTS, num_groups=2, seed=7, average_every=2)) == sync
    for name, value in [("seed", 7), ("seed", np.int64(0)), ("topology", None), ("overlap", False),
                        ("average_buffers", False), ("num_groups", 2)]:
        with pytest.raises(ValueError, match=f"not both \\(got ``{name}``\\)"):
            config_of(sync, dict(TORCH_DEFAULTS, **{name: value}))
    with pytest.raises(TypeError, match="``sync`` must be a hvd_dssync.SyncConfig"):
        config_of({"seed": 7}, TORCH_DEFAULTS)


def test_the_keras_adapter_refuses_what_only_pytorch_does():
    with pytest.raises(ValueError, match="not supported by this adapter .PyTorch's only."):
        config_of(SyncConfig(outer_momentum=0.5), KERAS_DEFAULTS, unsupported=("outer_momentum",))
    assert config_of(SyncConfig(outer_momentum=0.0), KERAS_DEFAULTS, unsupported=("outer_momentum",)).outer_momentum == 0
    assert config_of(SyncConfig(overlap=True), KERAS_DEFAULTS, unsupported=("outer_momentum",)).overlap is True


def test_the_racks_are_refused_inside_a_process_set_either_way():
    for sync, keywords in [(None, dict(TORCH_DEFAULTS, schedule="topology", topology=None)),
                           (SyncConfig(schedule="topology", topology=None), TORCH_DEFAULTS)]:
        with pytest.raises(ValueError, match="not supported inside a process set"):
            config_of(sync, keywords, in_process_set=True)


def _sensing(racks):
    """What sensing finds (hvd_dssync.sensing.default_topology), ``sensed`` and ``nothing``: "auto" becomes
    ``racks``, or one rack (None); and the job's topology of what was found (``job``)."""
    sensed = lambda s, n, g, topology, o, w: (racks if topology == "auto" else topology, None)  # noqa: E731
    nothing = lambda s, n, g, topology, o, w: (None if topology == "auto" else topology, None)  # noqa: E731
    return sensed, nothing, lambda topology: Topology.from_racks(racks)


def test_average_every_defaults_to_local_steps_on_the_default_racks_only(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    racks = [[0, 1], [2, 3]]
    sensed, nothing, job = _sensing(racks)

    def every(sense, **arguments):
        config, _ = SyncConfig(**arguments).resolve(sense, job)
        return config.average_every, config.plan_arguments()["average_every"]

    assert every(sensed, topology="auto") == (RACK_AVERAGE_EVERY,) * 2  # the one-line swap on sensed racks
    assert every(nothing, topology=racks) == (RACK_AVERAGE_EVERY,) * 2  # racks given, schedule not named
    assert every(nothing, topology="auto") == (1, 1)  # one rack: random groups, every step
    assert every(nothing, schedule="topology", topology=racks) == (1, 1)  # the schedule named
    assert every(sensed, topology="auto", average_every=3) == (3, 3)  # given: kept
    assert every(sensed, topology="auto", policy="adaptive")[0] == 1  # the adaptive policy sets its periods
    assert SyncConfig().plan_arguments()["average_every"] == 1  # unresolved: every step


def test_the_default_racks_meet_in_global_averages_only_where_nothing_names_the_rhythm(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    racks = [[0, 1], [2, 3]]
    sensed, nothing, job = _sensing(racks)

    def rhythm(sense, routes=True, **arguments):
        config, _ = SyncConfig(**arguments).resolve(sense, job, routes=routes)
        schedule = config.schedule_for(4)
        return (config.plan_arguments()["global_every"], getattr(schedule, "intra_steps", "no racks"),
                getattr(schedule, "global_via_bridges", "no racks"))

    # The one-line swap on sensed racks: through the racks where nothing stands in the way (PyTorch's).
    assert rhythm(sensed) == (RACK_GLOBAL_EVERY, None, "auto")
    assert rhythm(sensed, routes=False) == (RACK_GLOBAL_EVERY, None, False)  # Keras: every rank at once
    assert rhythm(sensed, schedule_options={"global_via_bridges": False})[2] is False  # named: kept
    assert rhythm(nothing, topology=racks)[:2] == (RACK_GLOBAL_EVERY, None)  # racks given, schedule not named
    assert rhythm(sensed, global_every=16)[:2] == (16, None)  # given: kept, the racks meet there
    assert rhythm(sensed, global_every=0)[:2] == (0, 3)  # none: the bridges' steps are the racks' meeting
    assert rhythm(sensed, schedule_options={"intra_steps": 1})[:2] == (RACK_GLOBAL_EVERY, 1)  # named: kept
    assert rhythm(nothing, schedule="topology", topology=racks)[:2] == (0, 3)  # the schedule named
    assert rhythm(nothing) == (0, "no racks", False)  # one rack: random groups, no global averages
    assert rhythm(sensed, policy="adaptive")[:2] == (0, 3)  # the adaptive policy chooses its global averages
    assert SyncConfig().plan_arguments()["global_every"] == SyncConfig().plan_data()["global_every"] == 0  # never


def test_the_plain_swap_on_a_flat_network_of_hosts_averages_over_every_rank_with_local_steps(monkeypatch):
    from hvd_dssync.sensing import Sensed

    monkeypatch.delenv(ENV_VAR, raising=False)
    job = lambda topology: topology  # noqa: E731

    def resolved(sensed, **arguments):
        config, _ = SyncConfig(**arguments).resolve(lambda *a: (sensed.topology() if sensed else None, sensed), job)
        return config.schedule, config.num_groups, config.average_every

    flat = Sensed("measured", None, hosts=8)
    assert resolved(flat, topology="auto") == ("shuffle", 1, FLAT_AVERAGE_EVERY)  # one group of every rank
    assert resolved(Sensed("not probed", None, hosts=20), topology="auto") == ("shuffle", 1, FLAT_AVERAGE_EVERY)
    assert resolved(flat, topology="auto", average_every=1) == ("shuffle", 1, 1)  # given: kept
    assert resolved(Sensed("one host", None), topology="auto") == ("shuffle", None, 1)  # random groups
    assert resolved(None, topology="auto") == ("shuffle", None, 1)  # nothing sensed (arguments named it)


@pytest.mark.parametrize("arguments,named", [
    ({"num_groups": 0}, "num_groups"), ({"group_size": 1.5}, "group_size"), ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"), ({"schedule": "ring"}, "schedule"), ({"schedule": 3}, "schedule"),
    ({"warmup_steps": -1}, "warmup_steps"), ({"global_every": 1.0}, "global_every"),
    ({"average_every": 0}, "average_every"), ({"schedule_options": [1]}, "schedule_options"),
    ({"policy": "sometimes"}, "policy"), ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"overlap": 1}, "overlap"), ({"average_buffers": None}, "average_buffers"),
    ({"sparse_average": "yes"}, "sparse_average"),
    # conflicts, the argument named
    ({"num_groups": 2, "group_size": 2}, "group_size"), ({"schedule": "butterfly", "num_groups": 2}, "num_groups"),
    ({"schedule": "topology", "num_groups": 2}, "num_groups"),
    ({"topology": [[0, 1], [2, 3]], "group_size": 2}, "group_size"),
    ({"policy": "adaptive", "global_every": 4}, "global_every"),
])
def test_invalid_arguments_are_refused_by_name(monkeypatch, arguments, named):
    monkeypatch.delenv(ENV_VAR, raising=False)
    # A value of the wrong type raises the schedules' TypeError, as the plan does.
    with pytest.raises((ValueError, TypeError), match=f"``{named}``"):
        SyncConfig(**arguments)


@pytest.mark.parametrize("arguments", [
    {"num_groups": 0}, {"num_groups": 1.5}, {"group_size": 0}, {"seed": -1}, {"seed": 0.5}, {"seed": "0"},
    {"seed": None}, {"schedule": "shufle"}, {"schedule": 3}, {"warmup_steps": -1}, {"average_every": 0},
    {"policy": "sometimes"}, {"num_groups": 2, "group_size": 2}, {"schedule": "butterfly", "num_groups": 2},
    {"schedule": "butterfly", "group_size": 1.5}, {"schedule": "topology", "group_size": 2},
    {"policy": "adaptive", "global_every": 4},
])
def test_the_errors_are_the_plans(monkeypatch, arguments):
    """The configuration refuses what the plan refuses, with the plan's very error, before any world size."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    planned_arguments = {("adaptive" if k == "policy" else k): v for k, v in arguments.items()}
    with pytest.raises((ValueError, TypeError)) as planned:
        SyncPlan(0, 4, **planned_arguments)
    with pytest.raises(type(planned.value)) as configured:
        SyncConfig(**arguments)
    assert str(configured.value) == str(planned.value)


def test_accepted_as_the_plan_accepts(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert SyncConfig(num_groups=np.int64(2), seed=np.int64(3)).plan_arguments()["seed"] == 3
    assert SyncConfig(schedule="butterfly", seed=-1).schedule_for(4).config()["name"] == "butterfly"
    assert SyncConfig(schedule=Butterfly(4), seed=None).schedule_for(4) is not None
    assert SyncConfig(topology="auto", num_groups=2).topology == "auto"  # sensed by resolve()


def test_the_racks_from_the_environment_refuse_sizes(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "[[0, 1], [2, 3]]")
    with pytest.raises(ValueError, match="``num_groups``.*HVD_DSSYNC_TOPOLOGY is set"):
        SyncConfig(num_groups=3)
    assert SyncConfig(num_groups=3, schedule="shuffle").num_groups == 3


def test_frozen_and_options_copied():
    options = {"window_steps": 4}
    config = SyncConfig(num_groups=2, schedule_options=options)
    options["window_steps"] = 8
    assert config.schedule_options == {"window_steps": 4}
    with pytest.raises(Exception):
        config.seed = 3


def test_dict_round_trip_is_plain_data():
    config = SyncConfig(group_size=2, seed=4, warmup_steps=3, average_every=2, policy=AdaptivePolicy(max_period=4),
                        schedule_options={"window_steps": None}, outer_momentum=0.5, overlap=True)
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["policy"]["max_period"] == 4
    again = SyncConfig.from_dict(data)
    assert again.to_dict() == data
    assert SyncPlan.from_config(1, 4, again).config() == SyncPlan.from_config(1, 4, config).config()
    with pytest.raises(ValueError, match="unknown keys \\['ranks'\\]"):
        SyncConfig.from_dict(dict(data, ranks=4))


def test_schedule_objects_and_topologies_as_data():
    racks = Topology.from_racks([[0, 1], [2, 3]])
    data = SyncConfig(topology=racks).to_dict()
    assert data["topology"]["racks"] == [[0, 1], [2, 3]]
    assert SyncConfig.from_dict(data).schedule_for(4).config()["racks"] == [[0, 1], [2, 3]]
    data = SyncConfig(schedule=Butterfly(4)).to_dict()
    assert data["schedule"] == {"name": "butterfly", "world_size": 4, "group_size": 2}
    with pytest.raises(ValueError, match="``schedule``: a schedule object cannot be rebuilt"):
        SyncConfig.from_dict(data)


def test_for_world_caps_the_sizes_and_refuses_fixed_ranks():
    assert SyncConfig(num_groups=4).for_world(3) == SyncConfig(num_groups=3)
    assert SyncConfig(group_size=2, seed=7).for_world(8) == SyncConfig(group_size=2, seed=7)
    with pytest.raises(RuntimeError, match="built for a fixed set of ranks"):
        SyncConfig(schedule="topology", topology=[[0], [1]]).for_world(2)


def test_schedule_for_is_the_plans():
    config = SyncConfig(num_groups=2, seed=9)
    assert config.schedule_for(8).config() == SyncPlan(0, 8, num_groups=2, seed=9).schedule.config()
    assert build_schedule(1).config()["num_groups"] == 1
    with pytest.raises(ValueError, match="``num_groups`` must be at most the world size 2"):
        SyncConfig(num_groups=3).schedule_for(2)


def _no_sensing(schedule, num_groups, group_size, topology, schedule_options, whole_job):
    return (None if topology == "auto" else topology), None


def test_resolve_senses_then_resolves_the_schedule_and_the_racks(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    asked = []

    def job_topology(spec):
        asked.append(spec)
        return Topology.from_racks(spec)

    config, sensed = SyncConfig(num_groups=2, topology="auto").resolve(_no_sensing, job_topology)
    assert (config.schedule, config.topology, sensed, asked) == ("shuffle", None, None, [])

    def sense(*arguments):
        return [[0, 1], [2, 3]], "sensed"

    config, sensed = SyncConfig().resolve(sense, job_topology)
    assert (config.schedule, sensed, asked) == ("topology", "sensed", [[[0, 1], [2, 3]]])
    assert config.plan_data()["topology"]["racks"] == [[0, 1], [2, 3]]
    assert SyncPlan.from_config(0, 4, config).schedule.config()["name"] == "topology"


def test_resolve_refuses_the_racks_inside_a_process_set(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="``process_set``"):
        SyncConfig(schedule="topology").resolve(_no_sensing, Topology.from_racks, in_process_set=True)
    monkeypatch.setenv(ENV_VAR, "[[0, 1], [2, 3]]")  # the racks of the environment make the default topology-aware
    with pytest.raises(ValueError, match="``process_set``"):
        SyncConfig().resolve(_no_sensing, Topology.from_racks, in_process_set=True)
    config, _ = SyncConfig(group_size=2, schedule="shuffle").resolve(_no_sensing, Topology.from_racks, True)
    assert config.schedule == "shuffle"


def test_plan_data_is_the_plans_arguments_as_data():
    config = SyncConfig(schedule="shuffle", group_size=2, seed=4, policy="adaptive", overlap=True)
    data = config.plan_data()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == set(config.plan_arguments())
    assert data["adaptive"] == config.adaptive().config() and "overlap" not in data
