"""The default's sensing of the network (hvd_dssync.sensing): the decisions alone, with no Horovod."""
import math

import numpy as np
import pytest

from hvd_dssync import sensing
from hvd_dssync.topology import host_name
from hvd_dssync.sensing import (AUTO, MIN_MARGIN, PairProbe, Sensed, decide_racks, layout, local_address, measure,
                                pair_rounds, pair_seconds, probe_rounds, rank_racks, sense, sense_once,
                                wants_sensing)

NAN = math.nan


def two_racks(ps):
    """Seconds of a transfer between hosts ``ps`` of 8, ranks 0-3 and 4-7 behind a 10x slower link."""
    a, b = ps
    return 0.01 if (a < 4) == (b < 4) else 0.1


class FakeProbe:
    """A stand-in for PairProbe: the seconds of ``two_racks``; records the pairs it met."""

    def __init__(self, address=None):
        self.met, self.closed = [], False

    def endpoint(self):
        return ["10.0.0.1", 1]

    def client(self, rank, endpoint, nbytes, repeats):
        self.met.append(("client", endpoint[1]))
        return two_racks((rank, endpoint[1]))

    def server(self, partner, nbytes, repeats):
        self.met.append(("server", partner))

    def close(self):
        self.closed = True


def test_layout_one_host_hosts_or_measure():
    assert layout(["h"] * 4) == ("one host", None)
    # Two hosts with several ranks each: each host is a rack, whatever the order of the ranks.
    assert layout(["a", "a", "b", "b"]) == ("hosts", [[0, 1], [2, 3]])
    # Three hosts or more may share uplinks: their first ranks are measured, whatever ranks they run.
    assert layout(["b", "a", "b", "a", "c", "c"]) == ("measure", [0, 1, 4])
    # One rank per host (the bench): nothing to read from the layout; each host's first rank is measured.
    assert layout([f"ns{r}" for r in range(8)]) == ("measure", list(range(8)))
    # A host with one rank among hosts of several: the hosts' first ranks are measured.
    assert layout(["a", "a", "b", "c", "c"]) == ("measure", [0, 2, 3])


def test_probe_rounds_meet_every_pair_once_in_disjoint_rounds():
    rounds = probe_rounds(list(range(8)))
    assert len(rounds) == 7 and all(len(pairs) == 4 for pairs in rounds)
    assert sorted(p for pairs in rounds for p in pairs) == sorted((a, b) for a in range(8) for b in range(a + 1, 8))
    for pairs in rounds:
        ranks = [r for p in pairs for r in p]
        assert len(ranks) == len(set(ranks))
    assert sorted(p for pairs in probe_rounds([0, 2, 5]) for p in pairs) == [(0, 2), (0, 5), (2, 5)]


def endpoints(n):
    return [["10.0.0.1", r] for r in range(n)]


def test_measure_sends_to_the_higher_ranks_and_serves_the_lower_ones():
    probe = FakeProbe()
    row = measure(5, list(range(8)), endpoints(8), probe)
    assert sorted(probe.met) == [("client", 6), ("client", 7)] + [("server", r) for r in range(5)]
    # Only the sending end has a figure; the receiving end's is NaN (the figures' max takes the one there is).
    assert row[[6, 7]].tolist() == [0.01, 0.01] and np.isnan(row[[0, 1, 2, 3, 4, 5]]).all()
    # A rank that leads no host (not its host's first rank) meets nobody.
    probe = FakeProbe()
    assert np.isnan(measure(1, [0, 2], endpoints(3), probe)).all() and probe.met == []


def test_a_failed_transfer_leaves_a_missing_figure():
    class Failing(FakeProbe):
        def client(self, rank, endpoint, nbytes, repeats):
            raise ConnectionRefusedError("refused")

    assert np.isnan(measure(0, [0, 1], endpoints(2), Failing())).all()


def test_a_capped_transfer_stops_early_and_is_scaled_to_the_full_size(monkeypatch):
    """Past its time a transfer sends no more chunks, the server still reads what came, and the figure is
    the time scaled to the full size (a slow link is timed on what it carried). A clock that ticks one
    second per reading: in the sizing transfer and the timed one, one chunk of 64 goes out and 2 s pass; the
    figure is 2 * 64 s."""
    import itertools
    import threading

    ticks = itertools.count()
    monkeypatch.setattr(sensing.probe.time, "perf_counter", lambda: float(next(ticks)))
    server, client = PairProbe("127.0.0.1", timeout=10), PairProbe("127.0.0.1", timeout=10)
    nbytes = 64 * sensing.SENSE_CHUNK
    try:
        thread = threading.Thread(target=server.server, args=(0, nbytes, 1))
        thread.start()
        seconds = client.client(0, server.endpoint(), nbytes, 1, cap_seconds=0.5)
        thread.join(10)
        assert not thread.is_alive()
        assert seconds == 2 * 64
    finally:
        server.close()
        client.close()


def test_pair_probe_times_a_real_transfer():
    """Two PairProbes on loopback, one serving in a thread: the client's seconds, the server's acknowledgements."""
    import threading

    server, client = PairProbe("127.0.0.1", timeout=10), PairProbe("127.0.0.1", timeout=10)
    try:
        thread = threading.Thread(target=server.server, args=(0, 65536, 2))
        thread.start()
        seconds = client.client(0, server.endpoint(), 65536, 2)
        thread.join(10)
        assert not thread.is_alive() and 0 < seconds < 5
    finally:
        server.close()
        client.close()
    assert server.endpoint() is None
    assert PairProbe(None).endpoint() is None


def racks_from_figures(rows, leaders, hosts):
    """The racks of ranks every rank builds from the gathered ``rows``, and the rule's decision."""
    decision = decide_racks(pair_seconds(rows, leaders))
    return rank_racks(decision.racks, leaders, hosts), decision


def test_every_rank_builds_the_same_racks_from_one_allgather():
    leaders = list(range(8))
    rows = [measure(r, leaders, endpoints(8), FakeProbe()) for r in range(8)]
    hosts = [f"ns{r}" for r in range(8)]
    racks, decision = racks_from_figures(rows, leaders, hosts)
    assert racks == [[0, 1, 2, 3], [4, 5, 6, 7]] and decision.sure and decision.margin == pytest.approx(10)
    # Each pair's figure is the larger of its two ends', so both ends decide alike.
    rows[0][1], rows[1][0] = 0.01, 0.2  # as if both ends had timed it
    assert pair_seconds(rows, leaders)[0, 1] == 0.2
    # A host linked fast to some members of its rack and slow to one is a contradiction, not a rack: unsure,
    # one flat network, and the pairs in doubt (the slow one inside, the links across) are to be timed again.
    racks, decision = racks_from_figures(rows, leaders, hosts)
    assert racks == [list(range(8))] and not decision.sure and decision.margin == pytest.approx(0.5)
    assert (0, 1) in decision.ambiguous and (0, 4) in decision.ambiguous and (0, 2) not in decision.ambiguous
    # A link inside 3x slower than the fastest across: far from racks, but one stall may be all that stands
    # between: it is timed again, with the links across that the racks' other links leave in doubt (none).
    rows[0][1], rows[1][0] = 0.3, 0.3
    racks, decision = racks_from_figures(rows, leaders, hosts)
    assert racks == [list(range(8))] and not decision.sure and decision.ambiguous == [(0, 1)]
    # Five such links inside, more than one for every two hosts: no racks, sure, nothing timed again.
    for a, b in ((0, 2), (0, 3), (1, 2), (4, 5)):
        rows[a][b] = rows[b][a] = 0.3
    racks, decision = racks_from_figures(rows, leaders, hosts)
    assert racks == [list(range(8))] and decision.sure and decision.ambiguous == []


def test_racks_of_hosts_carry_every_rank_of_the_host():
    # Hosts a (ranks 0, 1), b (2), c (3) and d (4): a and b close, c and d close, the two behind a slow link;
    # only leaders 0, 2, 3, 4 time.
    rows = [[NAN, 0.01, 0.1, 0.1], [NAN] * 4, [0.01, NAN, 0.1, 0.1], [0.1, 0.1, NAN, 0.01], [0.1, 0.1, 0.01, NAN]]
    assert racks_from_figures(rows, [0, 2, 3, 4], ["a", "a", "b", "c", "d"])[0] == [[0, 1, 2], [3, 4]]


def test_a_host_whose_every_link_is_slow_is_no_rack_of_its_own():
    """A lone host behind a slow link reads like a slow host (a busy core, a slow NIC): one flat network."""
    rows = [[NAN, 0.01, 0.1], [0.01, NAN, 0.1], [0.1, 0.1, NAN]]
    racks, decision = racks_from_figures(rows, [0, 1, 2], list("abc"))
    assert racks == [[0, 1, 2]] and decision.sure and math.isnan(decision.margin)


def test_a_flat_network_is_one_rack():
    rows = [[NAN if r == c else 0.01 + 0.001 * (r + c) for c in range(4)] for r in range(4)]
    racks, decision = racks_from_figures(rows, list(range(4)), list("abcd"))
    assert racks == [[0, 1, 2, 3]] and decision.sure and decision.describe() == "no rack structure"
    assert Sensed("measured", racks).racks is None and Sensed("measured", racks).found == "one rack"


# Recorded by the bench's accelerator network (8 emulated hosts, 4000 Mbit/s, 400 Mbit/s between 2 racks of 4):
# seconds per 512 KB. The rule of the fastest pair's half rate split these into five racks.
RECORDED = """0-1 .0026 0-2 .0044 0-3 .0020 1-2 .0036 1-3 .0031 2-3 .0026
4-5 .0010 4-6 .0035 4-7 .0028 5-6 .0049 5-7 .0028 6-7 .0021
0-4 .0291 0-5 .0146 0-6 .0311 0-7 .0476 1-4 .0148 1-5 .0229 1-6 .0419 1-7 .0370
2-4 .0134 2-5 .0269 2-6 .0341 2-7 .0244 3-4 .0204 3-5 .0276 3-6 .0137 3-7 .0219"""


def recorded_seconds():
    words = RECORDED.split()
    seconds = np.zeros((8, 8))
    for pair, value in zip(words[::2], words[1::2]):
        a, b = map(int, pair.split("-"))
        seconds[a, b] = seconds[b, a] = float(value)
    return seconds


def test_the_recorded_figures_of_two_racks_give_two_racks():
    decision = decide_racks(recorded_seconds())
    assert decision.racks == [[0, 1, 2, 3], [4, 5, 6, 7]] and decision.sure
    assert decision.margin == pytest.approx(0.0134 / 0.0049) and decision.describe() == "margin 2.7x"


def noisy_network(rng, sizes, ratio, noise, slow_host=1.0):
    """Seconds between hosts in racks of ``sizes``: 1 inside a rack, ``ratio`` across, each pair times a factor
    drawn log-uniformly in [1, ``noise``]; one host ``slow_host`` times slower on all its links."""
    rack = np.repeat(np.arange(len(sizes)), sizes)
    n = len(rack)
    base = np.where(rack[:, None] == rack[None, :], 1.0, ratio)
    factor = np.exp(rng.uniform(0, math.log(noise), (n, n)))
    seconds = np.triu(base * factor, 1)
    seconds = seconds + seconds.T
    host = rng.integers(n)
    seconds[host, :] *= slow_host
    seconds[:, host] *= slow_host
    np.fill_diagonal(seconds, 0.0)
    return seconds, [list(np.flatnonzero(rack == k)) for k in range(len(sizes))]


@pytest.mark.parametrize("sizes", [[4, 4], [3, 5], [2, 2, 2, 2], [2, 6], [5, 11], [8, 8], [6, 5, 5],
                                   [16, 16, 16, 16], [20, 44]])
@pytest.mark.parametrize("noise", [2.5, 4.0])
def test_racks_behind_a_10x_slower_link_are_found_under_noise(sizes, noise):
    """Racks of equal and unequal sizes, 2 to 4 racks, 8 to 64 hosts, a pair's figure anywhere in a range
    of ``noise`` x, every other draw with a slow host (1.2x on all its links): always the right racks (the
    margin stays above 10 / (noise * 1.2), at least 2)."""
    rng = np.random.default_rng(sum(sizes) * 10 + int(noise))
    for draw in range(40):
        seconds, truth = noisy_network(rng, sizes, 10.0, noise, slow_host=1.0 if draw % 2 else 1.2)
        decision = decide_racks(seconds)
        assert decision.racks == truth and decision.margin >= MIN_MARGIN, (draw, decision)


@pytest.mark.parametrize("hosts", [4, 8, 16, 64])
@pytest.mark.parametrize("noise", [3.0, 5.0])
def test_a_flat_network_under_noise_is_flat_and_racks_too_close_to_tell_are_never_wrong(hosts, noise):
    """The same noise on a flat network, with or without a slow host (3x on every link): one flat network
    in 95% of draws or more (4 hosts, two pairs against four: 5x noise makes two racks of 2 now and then);
    and racks behind a link only 3x slower, within the noise: the right racks or one flat network, never
    other racks."""
    rng = np.random.default_rng(hosts * 10 + int(noise))
    flat = 0
    for draw in range(100):
        seconds, _ = noisy_network(rng, [hosts], 1.0, noise, slow_host=3.0 if draw % 2 else 1.0)
        flat += decide_racks(seconds).flat
        seconds, truth = noisy_network(rng, [hosts // 2, hosts - hosts // 2], 3.0, noise)
        decision = decide_racks(seconds)
        assert decision.flat or decision.racks == truth, (draw, decision)
    assert flat >= 95


def test_pair_rounds_keep_each_round_disjoint_and_every_pair():
    pairs = [(0, 1), (0, 4), (1, 4), (2, 3), (0, 2), (5, 6)]
    rounds = pair_rounds(pairs)
    assert sorted(p for r in rounds for p in r) == sorted(pairs)
    for r in rounds:
        ends = [h for p in r for h in p]
        assert len(ends) == len(set(ends))
    assert rounds[0] == [(0, 1), (2, 3), (5, 6)]


def test_one_host_sends_nothing_and_finds_one_rack():
    def refuse(*args):
        raise AssertionError("no collective on one host")

    sensed = sense(0, 4, True, refuse, refuse, address=refuse, probe_class=refuse)
    assert (sensed.how, sensed.found, sensed.racks, sensed.topology()) == ("one host", "one rack", None, None)
    assert sensed.seconds < 0.01
    assert sense(0, 1, False, refuse, refuse, address=refuse, probe_class=refuse).how == "one host"


def gather_of(hosts, endpoint=("10.0.0.1", 1)):
    return lambda mine: [[h, list(endpoint) if endpoint else None] for h in hosts]


def test_hosts_with_several_ranks_each_are_the_racks_with_no_probe():
    def refuse(*args):
        raise AssertionError("no probe where the hosts say it all")

    probes = []
    sensed = sense(1, 4, False, gather_of(["a", "a", "b", "b"]), refuse, address=lambda: None,
                   probe_class=lambda address: probes.append(FakeProbe()) or probes[-1])
    assert (sensed.how, sensed.racks, sensed.hosts) == ("hosts", [[0, 1], [2, 3]], 2)
    assert sensed.topology().rack_ranks() == [[0, 1], [2, 3]]
    assert probes[0].met == [] and probes[0].closed


class FlatProbe(FakeProbe):
    def client(self, rank, endpoint, nbytes, repeats):
        self.met.append(("client", endpoint[1]))
        return 0.01


@pytest.mark.parametrize("probe_class,how,racks", [
    (FakeProbe, "measured", [[0, 1, 2, 3], [4, 5, 6, 7]]),  # hosts behind shared uplinks: racks of hosts
    (FlatProbe, "hosts", [[0, 1], [2, 3], [4, 5], [6, 7]]),  # a flat network between hosts: a rack per host
])
def test_three_hosts_or_more_of_several_ranks_are_measured(probe_class, how, racks):
    hosts = ["a", "a", "b", "b", "c", "c", "d", "d"]
    leaders = [0, 2, 4, 6]
    rows = [measure(r, leaders, endpoints(8), probe_class()) for r in range(8)]
    sensed = sense(5, 8, False, gather_of(hosts), lambda row: np.stack(rows), address=lambda: "10.0.0.1",
                   probe_class=probe_class)
    assert (sensed.how, sensed.racks, sensed.hosts, sensed.pairs) == (how, racks, 4, 6)


def test_hosts_of_several_ranks_without_a_probe_are_the_racks():
    """More hosts than are probed, or no address to probe on: each host of several ranks is a rack."""
    hosts = ["a", "a", "b", "b", "c", "c"]
    sensed = sense(0, 6, False, gather_of(hosts, endpoint=None), None, address=lambda: None,
                   probe_class=FakeProbe)
    assert (sensed.how, sensed.racks) == ("hosts", [[0, 1], [2, 3], [4, 5]])


def test_one_rank_per_host_is_measured_and_the_figures_gathered_once():
    gathered, objects = [], []
    rows = [measure(r, list(range(8)), endpoints(8), FakeProbe()) for r in range(8)]

    def allgather(row):
        gathered.append(row)
        return np.stack(rows)

    def allgather_object(mine):
        objects.append(mine)
        return [[f"ns{r}", ["10.0.0.1", r]] for r in range(8)]

    ticks = iter([9.0, 10.0, 12.5])  # sensing starts, the host names are in, the racks are known
    sensed = sense(3, 8, False, allgather_object, allgather, clock=lambda: next(ticks),
                   address=lambda: "10.0.0.1", probe_class=FakeProbe)
    assert len(objects) == 1 and objects[0] == [host_name(), ["10.0.0.1", 1]]
    assert len(gathered) == 1 and np.array_equal(gathered[0], rows[3], equal_nan=True)
    assert (sensed.how, sensed.racks, sensed.pairs, sensed.seconds) == ("measured", [[0, 1, 2, 3], [4, 5, 6, 7]],
                                                                        28, 2.5)
    record = sensed.to_dict()
    assert record["found"] == "2 racks" and record["seconds_by_pair"]["0-4"] == 0.1
    assert "2 racks" in sensed.describe() and "measured" in sensed.describe()


def test_pairs_in_doubt_are_timed_again_and_the_fastest_figure_counts():
    """Rank 0's first timing of its link to rank 1 (same rack) hits a stall: 0.2 s, slower than the links
    across. The rule is unsure; the pairs in its band (that one and the links across) are timed again, in a
    second pass and a second allgather, and the fastest figure of each pair decides: the two racks."""
    class Stalled(FakeProbe):
        def client(self, rank, endpoint, nbytes, repeats):
            first = ("client", endpoint[1]) not in self.met
            seconds = super().client(rank, endpoint, nbytes, repeats)
            return 0.2 if first and endpoint[1] == 1 else seconds

    others = [measure(r, list(range(8)), endpoints(8), FakeProbe()) for r in range(8)]
    mine = []

    def allgather(row):
        mine.append(row)
        return np.stack([row] + others[1:])

    sensed = sense(0, 8, False, lambda mine: [[f"ns{r}", e] for r, e in enumerate(endpoints(8))], allgather,
                   address=lambda: "10.0.0.1", probe_class=Stalled)
    assert (sensed.how, sensed.racks, sensed.retimed) == ("measured", [[0, 1, 2, 3], [4, 5, 6, 7]], 17), sensed
    assert len(mine) == 2 and mine[0][1] == 0.2 and mine[1][1] == 0.01
    assert math.isnan(mine[1][2]) and mine[1][4] == 0.1  # only the pairs in doubt are timed again
    assert sensed.margin == pytest.approx(10) and sensed.to_dict()["seconds_by_pair"]["0-1"] == 0.01
    assert "17 again" in sensed.describe() and "margin 10.0x" in sensed.describe()


def test_sensing_again_times_only_the_pairs_across_the_racks_in_force():
    """The watch saw the averages across the racks move (hvd_dssync.resense): sensing again times the 16
    pairs across the 2 racks of 4 in 4 rounds (not 28 in 7) and keeps the 12 inside; the link between the
    racks now as fast as the hosts' gives one flat network. Where the last sensing found no racks, every pair."""
    class Recovered(FakeProbe):
        def client(self, rank, endpoint, nbytes, repeats):
            self.met.append(("client", endpoint[1]))
            return 0.01

    hosts = [f"ns{r}" for r in range(8)]
    before = sense(0, 8, False, gather_of(hosts), lambda row: np.stack(
        [measure(r, list(range(8)), endpoints(8), FakeProbe()) for r in range(8)]), address=lambda: "10.0.0.1",
        probe_class=FakeProbe)
    assert before.racks == [[0, 1, 2, 3], [4, 5, 6, 7]] and before.pairs == 28
    pairs = [(a, b) for a in range(4) for b in range(4, 8)]
    probes = [Recovered() for _ in range(8)]
    rows = [measure(r, list(range(8)), endpoints(8), probes[r], pairs=pairs) for r in range(8)]
    probes.append(Recovered())
    again = sense(0, 8, False, gather_of(hosts), lambda row: np.stack(rows), address=lambda: "10.0.0.1",
                  probe_class=lambda address: probes[-1], previous=before)
    assert (again.racks, again.pairs) == (None, 16) and "16 pairs timed" in again.describe()
    assert len(probes[-1].met) == 4  # rank 0 timed its links to the other rack only
    assert again.to_dict()["seconds_by_pair"]["0-1"] == before.to_dict()["seconds_by_pair"]["0-1"]
    assert len(sensing.pair_rounds(pairs)) == 4
    assert sensing.known_figures(again, list(range(8))) is None  # no racks: the next sensing times every pair


def test_figures_that_stay_in_doubt_give_one_flat_network():
    """Racks only 1.5x apart, timed alike every pass: after RETIME_PASSES more passes, one flat network, and
    the reading says why."""
    class Close(FakeProbe):
        def client(self, rank, endpoint, nbytes, repeats):
            return 0.01 if (rank < 4) == (endpoint[1] < 4) else 0.015

    rows = [measure(r, list(range(8)), endpoints(8), Close()) for r in range(8)]
    calls = []
    sensed = sense(0, 8, False, lambda mine: [[f"ns{r}", e] for r, e in enumerate(endpoints(8))],
                   lambda row: calls.append(row) or np.stack(rows), address=lambda: "10.0.0.1", probe_class=Close)
    assert len(calls) == 1 + sensing.RETIME_PASSES and (sensed.how, sensed.racks) == ("measured", None)
    assert sensed.margin == 1.5 and "unsure: one flat network" in sensed.describe()


def test_no_probe_without_an_address_too_many_hosts_or_a_missing_figure():
    def refuse(*args):
        raise AssertionError("nothing to gather")

    # A host whose first rank has no address other hosts reach: nobody measures.
    hosts = [f"ns{r}" for r in range(4)]
    sensed = sense(0, 4, False, gather_of(hosts, endpoint=None), refuse, address=lambda: None,
                   probe_class=FakeProbe)
    assert (sensed.how, sensed.racks) == ("not probed", None)
    hosts = [f"h{r}" for r in range(sensing.MAX_PROBED_HOSTS + 1)]
    sensed = sense(0, len(hosts), False, gather_of(hosts), refuse, address=lambda: "10.0.0.1", probe_class=FakeProbe)
    assert (sensed.how, sensed.racks) == ("not probed", None)
    # A pair nobody could time: every rank sees it missing in the same gathered figures, and uses nothing.
    rows = np.full((4, 4), NAN)
    sensed = sense(0, 4, False, gather_of([f"ns{r}" for r in range(4)]), lambda row: rows,
                   address=lambda: "10.0.0.1", probe_class=FakeProbe)
    assert (sensed.how, sensed.racks) == ("not probed", None)


def test_loopback_is_no_address_for_other_hosts():
    assert local_address({"HOROVOD_GLOO_IFACE": "lo"}) is None


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


def _watch_checks(watch, windows, world_size=8, overlapped=()):
    """Feed ``windows`` (each: every rank's crossing averages' seconds of one check, a list per rank) to
    ``watch`` as the steps would, the windows numbered in ``overlapped`` as averages folded in from behind the
    steps, and return its decisions at each check."""
    decisions = []
    for k, window in enumerate(windows):
        figures = []
        for rank_seconds in window:
            for seconds in rank_seconds:
                watch.note(world_size, seconds, crosses=None, group_size=world_size, kind="group",
                           overlapped=k in overlapped)
            figures.append(watch.figure())
        decisions.append(watch.decide(figures))
    return decisions


def test_the_watch_senses_again_when_the_crossing_averages_slow_down_or_recover():
    from hvd_dssync.resense import NetworkWatch

    fast, slow = [[0.010, 0.03]] * 8, [[0.10, 0.12]] * 8
    # A flat network whose link drops: the second check's averages cost 10x the first's.
    assert _watch_checks(NetworkWatch(), [fast, fast, slow]) == [False, False, True]
    # Sensed again on the slow network, which then recovers.
    watch = NetworkWatch()
    _watch_checks(watch, [fast, slow])
    watch.restart()
    assert _watch_checks(watch, [slow, slow, fast]) == [False, False, True]
    # A check that straddles the drop keeps its cheaper average; the next one tells.
    assert _watch_checks(NetworkWatch(), [fast, [[0.010, 0.1]] * 8, slow]) == [False, False, True]


def test_the_watch_reads_the_link_not_a_straggler_nor_noise():
    from hvd_dssync.resense import NetworkWatch

    fast = [[0.010, 0.012]] * 8
    # A straggler: the others wait for it at every average, but it arrives last and waits for nobody.
    straggling = [[0.011]] + [[0.3, 0.4]] * 7
    assert _watch_checks(NetworkWatch(), [fast, straggling, straggling, fast]) == [False] * 4
    # Noise below the ratio, and a check where no rank crossed the network, decide nothing.
    noisy = [[0.03]] * 8
    assert _watch_checks(NetworkWatch(), [fast, noisy, [[]] * 8, fast]) == [False] * 4


@pytest.mark.parametrize("seed", range(50))
def test_the_watch_reads_no_overlapped_average(seed):
    """The default's trial of overlap times its averages waited for, then as many overlapped, whose seconds
    are what each delayed the step (a fraction of its cost, often almost nothing): read as costs, they moved
    the figure 4x on a network that had not changed, and the racks were sensed again for nothing (a flat
    network's job whose link then slowed stayed flat: the watch's reference was taken after the change).
    Generated noisy figures, 4 to 8 ranks."""
    from hvd_dssync.resense import NetworkWatch

    rng = np.random.default_rng(seed)
    ranks = int(rng.integers(4, 9))

    def window(low, high):
        return [list(rng.uniform(low, high, size=int(rng.integers(1, 3)))) for _ in range(ranks)]

    waited, hidden, slow = (0.010, 0.025), (0.0002, 0.004), (0.12, 0.30)
    trial = [window(*waited) for _ in range(4)] + [window(*hidden) for _ in range(4)]
    overlapped = set(range(4, 8))
    # The trial, then overlap off on the same network: nothing changed.
    assert not any(_watch_checks(NetworkWatch(), trial + [window(*waited) for _ in range(3)], ranks, overlapped))
    # The link slows in the trial's overlapped half (what an overlapped average delays then is anyone's guess):
    # the first check of averages waited for again tells.
    windows = trial[:6] + [window(0.2, 2.0), window(0.0002, 1.0)] + [window(*slow) for _ in range(3)]
    assert _watch_checks(NetworkWatch(), windows, ranks, overlapped) == [False] * 8 + [True, True, True]


def test_the_watch_counts_only_averages_across_the_network():
    from hvd_dssync.resense import NetworkWatch

    watch = NetworkWatch(warmup_steps=2, check_every=4)
    assert [watch.due(step) for step in range(10)] == [False] * 5 + [True] + [False] * 3 + [True]
    watch.note(8, 0.5, crosses=False, group_size=4, kind="group")  # inside a rack
    watch.note(8, 0.5, crosses=None, group_size=4, kind="group")   # a group of 4 of 8 on a flat network
    watch.note(8, 0.5, crosses=None, group_size=8, kind="bsp")     # the warm-up's gradients
    assert math.isnan(watch.figure())
    watch.note(8, 0.2, crosses=True, group_size=2, kind="group")   # a bridge
    watch.note(8, 0.3, crosses=None, group_size=8, kind="global")  # every rank
    assert watch.figure() == 0.2 and math.isnan(watch.figure())
    with pytest.raises(ValueError, match="check_every"):
        NetworkWatch(check_every=0)


ON = {"HVD_DSSYNC_RESENSE": "1"}


@pytest.mark.parametrize("how, adaptive, environ, expected", [
    ("measured", None, ON, True), ("measured", None, {}, False), ("measured", None, {"HVD_DSSYNC_RESENSE": "0"}, False),
    ("measured", {"decide_every": 16}, ON, False), ("hosts", None, ON, False), ("one host", None, ON, False),
    ("not probed", None, ON, False),
])
def test_only_measured_racks_under_the_fixed_policy_are_watched_when_asked(how, adaptive, environ, expected):
    from hvd_dssync.resense import watches

    assert watches(Sensed(how, None, hosts=8), adaptive, environ) is expected
    assert watches(None, None, environ) is False
