"""The simulator: averaging, spectral gap, link model and the table."""
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hvd_dssync.schedules import Butterfly, Shuffle, TopologyAware
from hvd_dssync.simulate import (bsp_ring_uplink_bytes, consensus_error, format_table, link_load, mixing_matrix,
                                 rack_topology, schedule_link_loads, simulate_table, spectral_gap, steps_to_error)
from hvd_dssync.topology import Topology


def test_consensus_error_of_one_step_matches_a_direct_computation():
    schedule = Shuffle(6, num_groups=2, seed=3)
    x = np.random.default_rng(9).standard_normal((6, 5))
    y = x.copy()
    for group in schedule.groups(0):
        y[list(group)] = x[list(group)].mean(axis=0)
    expected = np.linalg.norm(y - y.mean(0)) / np.linalg.norm(x - x.mean(0))
    assert consensus_error(schedule, 1, dim=5, seed=9)[0] == pytest.approx(expected, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n), st.integers(0, 1000))))
def test_consensus_error_never_increases(args):
    n, num_groups, seed = args
    errors = consensus_error(Shuffle(n, num_groups=num_groups, seed=seed, window_steps=3), 30, seed=seed)
    assert errors[0] <= 1 + 1e-12
    assert np.all(np.diff(errors) <= 1e-12)


def test_consensus_error_stalls_without_mixing_and_falls_with_it():
    static = Shuffle(4, num_groups=2, seed=0, partitions_per_window=1, window_steps=None)
    stuck = consensus_error(static, 20)
    assert stuck[-1] == pytest.approx(stuck[0]) and stuck[-1] > 0.1
    # Racks of two, one bridge every other step: the distance from consensus halves every two steps.
    bridged = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]), intra_steps=1)
    errors = consensus_error(bridged, 60)
    assert errors[-1] < 1e-8
    assert errors[3] == pytest.approx(errors[1] / 2, rel=1e-9)


def test_steps_to_error():
    assert steps_to_error([0.5, 0.1, 1e-3, 1e-5]) == 3
    assert steps_to_error([0.5, 0.1]) is None
    assert steps_to_error(consensus_error(Butterfly(16), 10)) == 4


def test_mixing_matrix_is_doubly_stochastic_and_matches_consensus_error():
    schedule = Shuffle(10, num_groups=3, seed=1)
    w = mixing_matrix(schedule, period=2)
    np.testing.assert_allclose(w.sum(axis=0), 1)
    np.testing.assert_allclose(w.sum(axis=1), 1)
    assert (w >= 0).all()
    x = np.random.default_rng(4).standard_normal((10, 3))
    x -= x.mean(0)
    expected = np.linalg.norm(w @ x) / np.linalg.norm(x)
    assert consensus_error(schedule, 2, dim=3, seed=4)[1] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8, 64, 512, 1024, 4096])
def test_butterfly_period_is_an_exact_average_for_powers_of_two(n):
    assert spectral_gap(Butterfly(n)) == pytest.approx(1.0, abs=1e-9)


def test_butterfly_mixed_radix_period_is_an_exact_average():
    for n in (6, 12, 30):
        assert spectral_gap(Butterfly(n, group_size=3)) == pytest.approx(1.0, abs=1e-9)


def test_spectral_gap_is_zero_for_a_schedule_that_never_connects():
    assert spectral_gap(Shuffle(8, num_groups=2, seed=0, partitions_per_window=1, window_steps=None)) \
        == pytest.approx(0.0, abs=1e-12)


def test_spectral_gap_of_a_rack_schedule_has_its_closed_form():
    # Racks of 8 average, then one rank per rack crosses: the bridge step leaves 7 of 8 ranks of each rack
    # at its rack mean, so the worst case keeps sqrt(7/8) of the distance from consensus.
    schedule = TopologyAware(rack_topology(64, 8))
    assert spectral_gap(schedule) == pytest.approx(1 - np.sqrt(7 / 8), rel=1e-9)
    assert spectral_gap(schedule, method="iterative") == pytest.approx(1 - np.sqrt(7 / 8), rel=1e-9)


@pytest.mark.parametrize("schedule", [Shuffle(96, group_size=4, seed=2), Shuffle(50, num_groups=7, seed=5),
                                      TopologyAware(rack_topology(40, 6), intra_steps=1)],
                         ids=["shuffle-96", "shuffle-50", "topology-40"])
def test_iterative_spectral_gap_agrees_with_the_dense_one(schedule):
    dense = spectral_gap(schedule, method="dense")
    assert 0 < dense < 1
    assert spectral_gap(schedule, method="iterative") == pytest.approx(dense, abs=1e-7)


def test_spectral_gap_bounds_the_error_of_each_period():
    schedule = Shuffle(40, num_groups=10, seed=8, window_steps=None)
    sigma = 1 - spectral_gap(schedule)
    errors = consensus_error(schedule, 20, dim=16, seed=3)
    assert errors[1] <= sigma + 1e-12
    assert all(errors[t + 2] <= sigma * errors[t] + 1e-12 for t in range(1, 17, 2))


def test_spectral_gap_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="``method``"):
        spectral_gap(Butterfly(4), method="lanczos")


@pytest.mark.parametrize("n,rack_size", [(4, 2), (8, 4), (64, 8), (100, 10), (4096, 8)])
def test_bsp_ring_puts_two_n_minus_one_over_n_of_the_model_on_each_uplink(n, rack_size):
    model = 1e6
    topology = rack_topology(n, rack_size)
    load = link_load([range(n)], topology, model)
    closed = 2 * (n - 1) / n * model
    assert bsp_ring_uplink_bytes(n, topology.num_racks, model) == closed
    assert load.uplink_bytes == pytest.approx(closed)
    assert load.cross_rack_bytes == pytest.approx(topology.num_racks * closed)
    assert load.host_bytes == pytest.approx(closed)
    assert load.seconds == pytest.approx(closed * 8 / 1e9)


def test_ring_in_one_rack_crosses_nothing():
    load = link_load([[0, 1, 2, 3]], Topology.from_racks([[0, 1, 2, 3]], intra_rack_gbps=10.0), 1000)
    assert (load.uplink_bytes, load.cross_rack_bytes) == (0.0, 0.0)
    assert load.seconds == pytest.approx(1500 * 8 / 10e9)


def test_group_rings_follow_sorted_order_and_share_uplinks():
    topology = Topology.from_racks([[0, 1], [2, 3]])
    # Ring 0 -> 2 -> 1 -> 3 -> 0 in sorted order 0,1,2,3 would cross twice; as groups {0,2},{1,3} each
    # pair ring sends S both ways, so rack 0's uplink carries 2 S out.
    assert link_load([[0, 2], [1, 3]], topology, 100).uplink_bytes == pytest.approx(200)
    assert link_load([[2, 0], [3, 1]], topology, 100) == link_load([[0, 2], [1, 3]], topology, 100)
    assert link_load([[0, 1], [2, 3]], topology, 100).uplink_bytes == 0


def test_link_load_counts_a_busier_incoming_direction():
    # Ring 0 -> 1 -> 2 -> 0 with racks {0}, {1, 2}: rack 1 gets one hop in and sends one out.
    topology = Topology.from_racks([[0], [1, 2]])
    assert link_load([[0, 1, 2]], topology, 300).uplink_bytes == pytest.approx(2 * 2 / 3 * 300)


def test_schedule_link_loads_of_topology_aware_crosses_once_per_period():
    topology = rack_topology(32, 8)
    loads = schedule_link_loads(TopologyAware(topology), topology, 1e6, 8)
    crossing = [l.uplink_bytes > 0 for l in loads]
    assert crossing == [False, False, False, True] * 2
    assert loads[3].uplink_bytes == pytest.approx(2 * 3 / 4 * 1e6)


def test_link_load_validates_its_arguments():
    topology = Topology.from_racks([[0, 1]])
    with pytest.raises(ValueError, match="``groups`` must cover"):
        link_load([[0]], topology, 10)
    with pytest.raises(ValueError, match="``model_bytes``"):
        link_load([[0, 1]], topology, 0)
    with pytest.raises(ValueError, match="``topology`` has 2 ranks"):
        schedule_link_loads(Butterfly(4), topology, 10, 2)


def test_consensus_error_validates_its_arguments():
    with pytest.raises(ValueError, match="``steps``"):
        consensus_error(Butterfly(4), -1)
    with pytest.raises(TypeError, match="``dim``"):
        consensus_error(Butterfly(4), 3, dim=2.0)


def test_simulate_table_rows():
    rows = simulate_table(workers=(8, 64), max_steps=300)
    by = {(r["workers"], r["schedule"]): r for r in rows}
    assert len(rows) == 8
    assert by[8, "bsp"]["steps_to_target"] == 1 and by[8, "bsp"]["speedup_vs_bsp"] == pytest.approx(1)
    assert by[64, "butterfly"]["steps_to_target"] == Butterfly(64, group_size=4).steps_to_consensus
    assert by[64, "topology"]["uplink_mb_per_step"] == pytest.approx(2 * 7 / 8 * 100 / 4)
    assert by[64, "topology"]["speedup_vs_bsp"] > 1
    assert by[64, "bsp"]["racks"] == 8 and by[8, "bsp"]["racks"] == 2
    assert all(0 <= r["spectral_gap"] <= 1 + 1e-9 for r in rows)
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| 64 | 8 | topology |" in table


def test_simulate_table_at_4096_workers_takes_seconds():
    started = time.monotonic()
    rows = simulate_table(workers=(4096,), max_steps=300)
    assert time.monotonic() - started < 60
    assert [r["schedule"] for r in rows] == ["bsp", "shuffle", "butterfly", "topology"]
    assert rows[0]["uplink_mb_per_step"] == pytest.approx(2 * 4095 / 4096 * 100)
