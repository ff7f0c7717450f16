"""The default's sensing of the network (hvd_dssync.sensing): the decisions alone, with no Horovod."""
import math

import numpy as np
import pytest

from hvd_dssync import sensing
from hvd_dssync.sensing import (AUTO, Sensed, layout, measure, probe_groups, racks_from_figures, sense, sense_once,
                                wants_sensing)

NAN = math.nan


class Registry:
    """A stand-in for the process-set registry: records what is acquired and released, in order."""

    def __init__(self):
        self.calls = []

    def acquire(self, groups):
        self.calls.append(("acquire", list(groups)))

    def release(self, groups):
        self.calls.append(("release", list(groups)))

    def get(self, group):
        assert self.calls and self.calls[-1][0] == "acquire" and tuple(group) in self.calls[-1][1]
        return tuple(group)


def two_racks(ps):
    """Seconds of an allreduce on pair ``ps`` of 8 hosts, ranks 0-3 and 4-7 behind a 10x slower link."""
    a, b = ps
    return 0.01 if (a < 4) == (b < 4) else 0.1


def test_layout_one_host_hosts_or_measure():
    assert layout(["h"] * 4) == ("one host", None)
    # Several hosts with several ranks each: each host is a rack, whatever the order of the ranks.
    assert layout(["a", "a", "b", "b"]) == ("hosts", [[0, 1], [2, 3]])
    assert layout(["b", "a", "b", "a", "c", "c"]) == ("hosts", [[0, 2], [1, 3], [4, 5]])
    # One rank per host (the bench): nothing to read from the layout; each host's first rank is measured.
    assert layout([f"ns{r}" for r in range(8)]) == ("measure", list(range(8)))
    # A host with one rank among hosts of several: the hosts' first ranks are measured.
    assert layout(["a", "a", "b", "c", "c"]) == ("measure", [0, 2, 3])


def test_probe_registers_every_pair_once_and_each_round_is_disjoint():
    rounds, groups = probe_groups(list(range(8)))
    assert len(rounds) == 7 and all(len(pairs) == 4 for pairs in rounds)
    assert groups == sorted((a, b) for a in range(8) for b in range(a + 1, 8))
    for pairs in rounds:
        ranks = [r for p in pairs for r in p]
        assert len(ranks) == len(set(ranks))
    # Leaders other than 0..n-1 (hosts' first ranks): pairs of those ranks.
    assert probe_groups([0, 2, 5])[1] == [(0, 2), (0, 5), (2, 5)]


def test_measure_acquires_once_times_its_own_pairs_and_releases_once():
    registry, timed = Registry(), []

    def time_allreduce(ps, name, warm):
        timed.append((ps, warm))
        return two_racks(ps)

    row = measure(5, list(range(8)), registry, time_allreduce, repeats=2)
    assert [c[0] for c in registry.calls] == ["acquire", "release"]
    assert registry.calls[0][1] == registry.calls[1][1] and len(registry.calls[0][1]) == 28
    # Rank 5 met each of the 7 others once: one unmeasured allreduce, then two timed ones.
    assert sorted({ps for ps, _ in timed}) == sorted(tuple(sorted((5, r))) for r in range(8) if r != 5)
    assert [warm for _, warm in timed] == [True, False, False] * 7
    assert math.isnan(row[5]) and row[[4, 6, 7]].tolist() == [0.01] * 3 and row[[0, 1, 2, 3]].tolist() == [0.1] * 4
    # A rank that leads no host (not its host's first rank) times nothing but acquires and releases alike.
    registry = Registry()
    assert np.isnan(measure(1, [0, 2], registry, time_allreduce)).all()
    assert [c[0] for c in registry.calls] == ["acquire", "release"]


def test_measure_keeps_each_pairs_fastest_allreduce():
    times = iter([9.0, 0.5, 0.02])  # the unmeasured one, a stall, then the link's time
    row = measure(0, [0, 1], Registry(), lambda ps, name, warm: next(times), repeats=2)
    assert math.isnan(row[0]) and row[1] == 0.02


def test_every_rank_builds_the_same_racks_from_one_allgather():
    leaders = list(range(8))
    rows = [measure(r, leaders, Registry(), lambda ps, name, warm: two_racks(ps)) for r in range(8)]
    hosts = [f"ns{r}" for r in range(8)]
    racks, by_pair = racks_from_figures(rows, leaders, hosts)
    assert racks == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(by_pair) == 28
    # Each pair's figure is the larger of its two ends', so both ends decide alike.
    rows[0][1], rows[1][0] = 0.01, 0.2
    assert racks_from_figures(rows, leaders, hosts)[1]["0-1"] == 0.2
    # One slow figure inside a rack does not split it: the rack's other fast links join it.
    assert racks_from_figures(rows, leaders, hosts)[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_racks_of_hosts_carry_every_rank_of_the_host():
    # Hosts a (ranks 0, 1) and b (2), c (3): a and b close, c behind a slow link; only leaders 0, 2, 3 time.
    rows = [[NAN, 0.01, 0.1], [NAN] * 3, [0.01, NAN, 0.1], [0.1, 0.1, NAN]]
    racks, _ = racks_from_figures(rows, [0, 2, 3], ["a", "a", "b", "c"])
    assert racks == [[0, 1, 2], [3]]


def test_a_flat_network_is_one_rack():
    rows = [[NAN if r == c else 0.01 + 0.001 * (r + c) for c in range(4)] for r in range(4)]
    racks, _ = racks_from_figures(rows, list(range(4)), list("abcd"))
    assert racks == [[0, 1, 2, 3]]
    assert Sensed("measured", racks).racks is None and Sensed("measured", racks).found == "one rack"


def test_one_host_sends_nothing_and_finds_one_rack():
    def refuse(*args):
        raise AssertionError("no collective on one host")

    sensed = sense(0, 4, True, refuse, refuse, refuse, refuse)
    assert (sensed.how, sensed.found, sensed.racks, sensed.topology()) == ("one host", "one rack", None, None)
    assert sensed.seconds < 0.01
    assert sense(0, 1, False, refuse, refuse, refuse, refuse).how == "one host"


def test_hosts_with_several_ranks_each_are_the_racks_with_no_probe():
    def refuse(*args):
        raise AssertionError("no probe where the hosts say it all")

    sensed = sense(1, 4, False, lambda: ["a", "a", "b", "b"], refuse, refuse, refuse)
    assert (sensed.how, sensed.racks, sensed.hosts) == ("hosts", [[0, 1], [2, 3]], 2)
    assert sensed.topology().rack_ranks() == [[0, 1], [2, 3]]


def test_one_rank_per_host_is_measured_and_the_figures_gathered_once():
    gathered = []
    rows = [measure(r, list(range(8)), Registry(), lambda ps, name, warm: two_racks(ps)) for r in range(8)]

    def allgather(row):
        gathered.append(row)
        return np.stack(rows)

    ticks = iter([10.0, 12.5])
    sensed = sense(3, 8, False, lambda: [f"ns{r}" for r in range(8)], Registry(),
                   lambda ps, name, warm: two_racks(ps), allgather, clock=lambda: next(ticks))
    assert len(gathered) == 1 and np.array_equal(gathered[0], rows[3], equal_nan=True)
    assert (sensed.how, sensed.racks, sensed.pairs, sensed.seconds) == ("measured", [[0, 1, 2, 3], [4, 5, 6, 7]],
                                                                        28, 2.5)
    record = sensed.to_dict()
    assert record["found"] == "2 racks" and record["seconds_by_pair"]["0-4"] == 0.1
    assert "2 racks" in sensed.describe() and "measured" in sensed.describe()


def test_too_many_hosts_are_not_probed():
    hosts = [f"h{r}" for r in range(sensing.MAX_PROBED_HOSTS + 1)]
    sensed = sense(0, len(hosts), False, lambda: hosts, None, None, None)
    assert (sensed.how, sensed.racks) == ("not probed", None)


@pytest.mark.parametrize("change, expected", [
    ({}, True),
    ({"schedule": "shuffle"}, False), ({"num_groups": 2}, False), ({"group_size": 2}, False),
    ({"schedule_options": {"window_steps": None}}, False), ({"topology": [[0, 1], [2, 3]]}, False),
    ({"topology": None}, False), ({"environ_topology": "[[0, 1], [2, 3]]"}, False), ({"whole_job": False}, False),
    ({"elastic": True}, False), ({"dynamic_sets": False}, False),
])
def test_only_the_plain_swap_senses(change, expected):
    arguments = dict(schedule=None, num_groups=None, group_size=None, topology=AUTO, schedule_options=None,
                     environ_topology="", whole_job=True, elastic=False, dynamic_sets=True)
    arguments.update(change)
    assert wants_sensing(**arguments) is expected


def test_sensing_runs_once_per_process_and_world():
    runs = []

    def run():
        runs.append(1)
        return Sensed("one host", None)

    first = sense_once(("test", 4, 0), run)
    assert sense_once(("test", 4, 0), run) is first and len(runs) == 1
    assert sensing.last_sensed() is first
    sense_once(("test", 3, 0), run)  # a new world (elastic): sensed again
    assert len(runs) == 2
