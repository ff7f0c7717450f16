"""Simulate a schedule on N virtual workers: consensus, mixing, and the bytes on the slowest link.

Everything here is numpy on arrays of length N; no N x N matrix is formed except by
:func:`mixing_matrix` (and :func:`spectral_gap` for ``N <= DENSE_LIMIT``), so N = 4096 takes seconds.

**Averaging.** A step averages uniformly inside each group of ``schedule.groups(t)``. Its matrix ``A_t``
is symmetric and doubly stochastic (a projection onto the vectors that are constant on each group), so
the global mean never changes and ``||A_t x - mean|| <= ||x - mean||``: the consensus error cannot grow.
No local updates are simulated: this isolates how fast a schedule mixes.

**Spectral gap.** Over one period of ``p`` steps the product is ``W = A_{p-1} ... A_1 A_0``, doubly
stochastic but in general not symmetric. With ``J = 11^T / N``, ``W J = J W = J`` and ``W`` maps the
vectors orthogonal to ``1`` into themselves, so for every ``x``::

    ||W x - mean(x) 1|| <= sigma ||x - mean(x) 1||,   sigma = ||W - J||_2 = sigma_2(W)

(the largest singular value of ``W`` on the complement of ``1``). The gap is ``1 - sigma``: the
guaranteed fraction by which one period shrinks the distance from consensus, 1 for an exact average,
0 for a schedule that never connects all workers. Singular values rather than eigenvalues because ``W``
is not symmetric: ``|lambda_2(W)| <= sigma`` and only ``sigma`` bounds every period.

**Links.** Racks are joined by a core switch; each rack's uplink (the shared slow link, at
``cross_rack_gbps``, full duplex) carries all traffic leaving the rack in one direction and all traffic
entering it in the other; each host's NIC runs at ``intra_rack_gbps``. Each group of a step runs a ring
allreduce among its members in sorted rank order, all groups at once. A ring of ``m`` ranks over a model
of ``S`` bytes sends, on each hop ``i -> next(i)``, ``m - 1`` chunks of ``S/m`` in the reduce-scatter and
``m - 1`` in the allgather::

    bytes per hop = 2 (m - 1) / m * S        (= what each rank sends; 0 for m = 1)

A hop between racks loads the sender's uplink (out) and the receiver's uplink (in). A step's time is
bandwidth only, ``max(uplink bytes / cross rate, NIC bytes / intra rate)`` over all links: no latency, no
compute, no overlap.

Closed form for bulk-synchronous training (BSP, one ring over all N ranks in rank order) on R >= 2 racks
of consecutive ranks: exactly R hops cross racks (one out of and one into each rack, counting the
wrap-around ``N-1 -> 0``), so every uplink carries ``2 (N - 1) / N * S`` each way and the cross-rack total
is ``R * 2 (N - 1) / N * S``; see :func:`bsp_ring_uplink_bytes`.

Where things are: :mod:`~hvd_dssync.simulate.mixing` (consensus error, mixing matrix, spectral gap),
:mod:`~hvd_dssync.simulate.links` (the link model), :mod:`~hvd_dssync.simulate.table` (the table of
``python -m hvd_dssync simulate``), :mod:`~hvd_dssync.simulate.replay` (the adaptive policy on a changing
network). Every name is imported from here.
"""
from .links import LinkLoad, bsp_ring_uplink_bytes, link_load, rack_topology, schedule_link_loads
from .mixing import DENSE_LIMIT, consensus_error, mixing_matrix, spectral_gap, steps_to_error
from .replay import parse_rate_changes, replay_adaptive
from .table import TABLE_SCHEDULES, format_table, simulate_table, table_schedules

__all__ = [
    "DENSE_LIMIT",
    "TABLE_SCHEDULES",
    "consensus_error",
    "steps_to_error",
    "mixing_matrix",
    "spectral_gap",
    "LinkLoad",
    "link_load",
    "schedule_link_loads",
    "bsp_ring_uplink_bytes",
    "rack_topology",
    "table_schedules",
    "simulate_table",
    "format_table",
    "parse_rate_changes",
    "replay_adaptive",
]
