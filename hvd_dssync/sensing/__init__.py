"""What the default schedule senses of the network when the optimizer is built (``topology="auto"``).

Without DS-Sync arguments, ``DistributedOptimizer`` looks for racks once per process, before the ranks'
agreement check, and averages in the topology-aware schedule on them where it finds two or more (else
today's default, random groups):

1. **One host** (Horovod's ``local_size() == size()``, every rank on one machine, as in ``make test``):
   nothing to find and nothing sent; the default is unchanged.
2. **Hosts**: one allgather of the hostnames (:func:`hvd_dssync.topology.host_name`). Where the job spans
   two hosts that each run several ranks, each host is a rack (:func:`layout`).
3. **Measured**: where that says nothing or not all (a host with one rank, as on the bench's one rank per
   emulated host; or three hosts and more, which may share uplinks), the first rank of each host times TCP
   transfers to every other host's, in round-robin rounds of disjoint pairs (:mod:`hvd_dssync.sensing.probe`;
   a fast link is timed over about ``SENSE_TARGET_SECONDS``, a slow one for at most ``SENSE_CAP_SECONDS``).
   Then one allgather of every rank's figures, from which every rank builds the same racks
   (:mod:`hvd_dssync.sensing.rule`: the partition whose links inside are all faster than its links across
   by :data:`MIN_MARGIN` or more). Where the figures leave the rule unsure, the pairs in doubt are timed
   again (at most :data:`RETIME_PASSES` times, one allgather each); still unsure, one flat network. Hosts
   that each run several ranks and turn out to share one flat network are each a rack, as in 2.

The result is a :class:`Sensed` (how, what was found, the rule's margin, what it cost), kept per process
(:func:`sense_once`), so a later optimizer of the same job probes nothing. Where the racks were measured,
the optimizer can watch the averages that cross the network and sense again when their cost moves
(:mod:`hvd_dssync.resense`). Numpy only: the adapters supply the collectives.

The package's parts: :mod:`~hvd_dssync.sensing.rule` (the racks from the figures),
:mod:`~hvd_dssync.sensing.probe` (the timed transfers) and :mod:`~hvd_dssync.sensing.job` (the layout, the
passes, the per-process cache and the adapters' entry points).
"""
from .job import (AUTO, MAX_PROBED_HOSTS, RETIME_PASSES, Sensed, default_topology, host_racks, last_sensed, layout,
                  names_schedule, known_figures, sense, sense_again, sense_once, wants_sensing)
from .probe import (SENSE_CAP_SECONDS, SENSE_CHUNK, SENSE_NBYTES, SENSE_REPEATS, SENSE_TARGET_SECONDS, PairProbe,
                    local_address, measure, pair_rounds, probe_rounds)
from .rule import MIN_MARGIN, RackDecision, decide_racks, pair_seconds, rank_racks, seconds_of_pairs

__all__ = ["AUTO", "Sensed", "layout", "host_racks", "probe_rounds", "pair_rounds", "local_address", "PairProbe",
           "measure", "MIN_MARGIN", "RackDecision", "decide_racks", "pair_seconds", "rank_racks", "seconds_of_pairs",
           "sense",
           "sense_once", "last_sensed", "wants_sensing", "names_schedule", "SENSE_NBYTES", "SENSE_REPEATS", "SENSE_CAP_SECONDS",
           "SENSE_TARGET_SECONDS", "SENSE_CHUNK", "MAX_PROBED_HOSTS", "RETIME_PASSES", "default_topology",
           "sense_again", "known_figures"]
