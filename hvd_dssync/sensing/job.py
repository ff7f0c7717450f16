"""The job's side of sensing: the host layout, the probe's passes and what every rank concludes.

See :mod:`hvd_dssync.sensing` for what is sensed when; the adapters supply the collectives.
"""
import logging
import math
import os
import time

import numpy as np

from ..process_sets import DYNAMIC_ENV, elastic_job
from ..topology import ENV_VAR as TOPOLOGY_ENV, Topology, host_name
from .probe import SENSE_NBYTES, SENSE_REPEATS, PairProbe, local_address, measure
from .rule import MIN_MARGIN, decide_racks, pair_seconds, rank_racks, seconds_of_pairs

__all__ = ["AUTO", "Sensed", "layout", "host_racks", "sense", "sense_once", "last_sensed", "wants_sensing", "names_schedule",
           "MAX_PROBED_HOSTS", "RETIME_PASSES", "default_topology", "sense_again", "known_figures"]

AUTO = "auto"  # the adapters' default ``topology=``: sense the racks when the optimizer is built
MAX_PROBED_HOSTS = 16  # more hosts than this are not probed (n (n - 1) / 2 pairs): pass the racks
# Where the figures leave the rack rule unsure, the ambiguous pairs are timed again (the fastest figure of
# a pair counts; pass k times each pair k + 1 times as often), at most this many more times; still unsure,
# the network is one flat network.
RETIME_PASSES = 2

log = logging.getLogger("hvd_dssync")

_cache = {}


class Sensed:
    """What sensing found: ``how`` ("one host", "hosts", "measured", or "not probed": too many hosts), the
    ``racks`` (lists of ranks; ``None`` for one rack), its cost in ``seconds`` (from the gathered host names
    on), the number of ``hosts`` and, when measured, the host pairs timed, their figures, the rack rule's
    ``margin`` (its confidence: the fastest link across racks over the slowest inside, the widest
    candidate's where it found one flat network) and how many pairs were timed again (``retimed``).

    Example::

        >>> s = Sensed("hosts", [[0, 1], [2, 3]], seconds=0.01, hosts=2)
        >>> s.found, s.topology().rack_ranks()
        ('2 racks', [[0, 1], [2, 3]])
        >>> Sensed("one host", None).to_dict()["found"]
        'one rack'
    """

    def __init__(self, how, racks, seconds=0.0, hosts=1, pairs=0, seconds_by_pair=None, margin=None, retimed=0,
                 reading=""):
        self.how = how
        self.racks = [list(r) for r in racks] if racks is not None and len(racks) > 1 else None
        self.seconds = float(seconds)
        self.hosts = int(hosts)
        self.pairs = int(pairs)
        self.seconds_by_pair = seconds_by_pair
        self.margin = None if margin is None or math.isnan(margin) else round(float(margin), 3)
        self.retimed = int(retimed)
        self.reading = reading

    @property
    def found(self):
        return "one rack" if self.racks is None else f"{len(self.racks)} racks"

    def topology(self):
        """A :class:`hvd_dssync.topology.Topology` of the racks, or ``None`` for one rack."""
        return None if self.racks is None else Topology.from_racks(self.racks)

    def to_dict(self):
        out = {"how": self.how, "found": self.found, "racks": self.racks, "seconds": self.seconds,
               "hosts": self.hosts, "pairs": self.pairs}
        if self.seconds_by_pair is not None:
            out.update(seconds_by_pair=self.seconds_by_pair, margin=self.margin, retimed=self.retimed,
                       reading=self.reading)
        return out

    def describe(self):
        racks = "" if self.racks is None else f" {self.racks}"
        timed = ""
        if self.pairs:
            timed = f", {self.pairs} pairs timed" + (f" ({self.retimed} again)" if self.retimed else "")
            timed += f", {self.reading}" if self.reading else ""
        return (f"hvd_dssync: sensed {self.found}{racks} ({self.how}, {self.hosts} host(s){timed}) "
                f"in {self.seconds:.3f} s")

    def __repr__(self):
        return f"Sensed(how={self.how!r}, racks={self.racks}, seconds={self.seconds:.3f}, margin={self.margin})"


def names_schedule(schedule, num_groups, group_size, schedule_options):
    """Whether DS-Sync's arguments name the schedule (then ``topology="auto"`` senses nothing).

    Example::

        >>> names_schedule(None, None, None, None), names_schedule(None, 2, None, None)
        (False, True)
    """
    return (schedule, num_groups, group_size, schedule_options) != (None, None, None, None)


def wants_sensing(schedule, num_groups, group_size, topology, schedule_options, environ_topology, whole_job,
                  elastic, dynamic_sets):
    """Whether the optimizer senses: ``topology`` is "auto" and nothing else names the schedule.

    Not where ``schedule``, ``num_groups``, ``group_size`` or ``schedule_options`` are given (they name the
    schedule), where ``HVD_DSSYNC_TOPOLOGY`` is set (``environ_topology``: it wins), inside a process set
    other than the whole job (``whole_job`` False), in an elastic job (a joining worker may run no collective
    at construction) or without dynamic process sets (``dynamic_sets`` False: ``hvd_dssync.torch.init``
    registered the default's groups statically, and no other set can be added). No communication.

    Example::

        >>> wants_sensing(None, None, None, "auto", None, "", True, False, True)
        True
        >>> wants_sensing(None, 2, None, "auto", None, "", True, False, True)  # num_groups: the shuffle
        False
    """
    return (isinstance(topology, str) and topology == AUTO
            and not names_schedule(schedule, num_groups, group_size, schedule_options)
            and not environ_topology and whole_job and not elastic and dynamic_sets)


def layout(rank_hosts):
    """What Horovod's host layout says: ``("one host", None)``; ``("hosts", racks)`` for two hosts that
    each run several ranks (a rack per host: nothing more to learn); else ``("measure", leaders)``: the
    lowest rank of each host, in the order of the hosts' first ranks (three hosts or more may share
    uplinks, so their links are timed; see :func:`host_racks` for what the hosts alone say).

    Example::

        >>> layout(["a", "a", "a"])
        ('one host', None)
        >>> layout(["a", "b", "a", "b"])
        ('hosts', [[0, 2], [1, 3]])
        >>> layout(["a", "b", "c", "d"])
        ('measure', [0, 1, 2, 3])
        >>> layout(["a", "a", "b", "b", "c", "c"])
        ('measure', [0, 2, 4])
    """
    ranks = _ranks_by_host(rank_hosts)
    if len(ranks) == 1:
        return "one host", None
    racks = host_racks(rank_hosts)
    if racks is not None and len(ranks) == 2:
        return "hosts", racks
    return "measure", [r[0] for r in ranks]


def _ranks_by_host(rank_hosts):
    """Each host's ranks, the hosts in the order of their first ranks."""
    return [[r for r, h in enumerate(rank_hosts) if h == host] for host in dict.fromkeys(rank_hosts)]


def host_racks(rank_hosts):
    """A rack per host (sorted lists of ranks) where every host runs several ranks, else ``None``.

    Example::

        >>> host_racks(["b", "a", "b", "a"])
        [[0, 2], [1, 3]]
        >>> host_racks(["a", "a", "b"]) is None
        True
    """
    ranks = _ranks_by_host(rank_hosts)
    return sorted(ranks) if len(ranks) > 1 and all(len(r) > 1 for r in ranks) else None


def sense(rank, world_size, one_host, allgather_object, allgather, nbytes=SENSE_NBYTES, repeats=SENSE_REPEATS,
          min_margin=MIN_MARGIN, clock=time.perf_counter, address=local_address, probe_class=PairProbe,
          previous=None):
    """Sense the racks (see :mod:`hvd_dssync.sensing`); a collective with the same op sequence on every rank.

    ``one_host``: Horovod says every rank is on this host (then nothing is sent);
    ``allgather_object(obj)``: every rank's object, by rank (one allgather of each rank's host name and
    probe endpoint); ``allgather(row)``: every rank's figures row (a float64 vector), stacked by rank, once per
    pass of the probe (:data:`RETIME_PASSES`: every rank decides alike whether another pass runs).
    Where some host's first rank has no address other hosts reach, more than :data:`MAX_PROBED_HOSTS` hosts
    would be probed, or a pair could not be timed, nothing is measured ("not probed": one rack).
    ``previous``: the :class:`Sensed` of an earlier sensing of the same hosts, where the averages across its
    racks changed cost (:mod:`hvd_dssync.resense`): only the pairs across its racks are timed, a pair inside
    one of them keeps its figure (:func:`known_figures`).

    Example::

        >>> sense(0, 4, True, None, None).to_dict()["how"]
        'one host'
        >>> sense(0, 4, False, lambda mine: [["a", None], ["a", None], ["b", None], ["b", None]], None).racks
        [[0, 1], [2, 3]]
    """
    started = clock()
    if world_size == 1 or one_host:
        return Sensed("one host", None, clock() - started)
    probe = probe_class(address())
    try:
        gathered = allgather_object([host_name(), probe.endpoint()])
        # The sensing's own seconds from here: not the wait for the last rank to reach the job's first
        # collective, which the ranks' agreement check right after would wait as long.
        started = clock()
        rank_hosts = [h for h, _ in gathered]
        endpoints = [e for _, e in gathered]
        how, found = layout(rank_hosts)
        hosts = len(set(rank_hosts))
        if how != "measure":
            return Sensed(how, found, clock() - started, hosts)
        leaders = found
        by_host = host_racks(rank_hosts)  # where the links between the hosts say nothing more
        fallback = "not probed" if by_host is None else "hosts"
        if len(leaders) > MAX_PROBED_HOSTS or any(endpoints[r] is None for r in leaders):
            return Sensed(fallback, by_host, clock() - started, hosts)
        seconds = known_figures(previous, leaders)
        pairs = None if seconds is None else [(a, b) for a, b in zip(*np.triu_indices(len(leaders), 1))
                                              if np.isinf(seconds[a, b])]
        timed_pairs, retimed = len(leaders) * (len(leaders) - 1) // 2 if pairs is None else len(pairs), 0
        for attempt in range(1 + RETIME_PASSES):
            # A pass again times fewer pairs, each with more transfers: its fastest is likelier the link's.
            row = measure(rank, leaders, endpoints, probe, nbytes, repeats * (1 + attempt), pairs)
            timed = pair_seconds(allgather(row), leaders)
            seconds = timed if seconds is None else np.fmin(seconds, timed)  # a pair not timed again: inf
            if np.isinf(seconds).any():
                break
            decision = decide_racks(seconds, min_margin)
            if decision.sure or not decision.ambiguous or attempt == RETIME_PASSES:
                break
            pairs = decision.ambiguous
            retimed += len(pairs)
    finally:
        probe.close()
    by_pair = {f"{leaders[a]}-{leaders[b]}": round(float(seconds[a, b]), 6)
               for a in range(len(leaders)) for b in range(a + 1, len(leaders))}
    if np.isinf(seconds).any():
        return Sensed(fallback, by_host, clock() - started, hosts, timed_pairs, by_pair)
    reading = decision.describe(min_margin) + ("" if decision.sure else ", unsure: one flat network")
    if decision.flat and by_host is not None:  # hosts on a flat network: each host is a rack
        return Sensed("hosts", by_host, clock() - started, hosts, timed_pairs, by_pair, decision.margin, retimed,
                      reading)
    return Sensed("measured", rank_racks(decision.racks, leaders, rank_hosts), clock() - started, hosts,
                  timed_pairs, by_pair, decision.margin, retimed, reading)


def known_figures(previous, leaders):
    """The figures of ``previous`` (a :class:`Sensed`) a sensing again of the hosts of ``leaders`` keeps: the
    symmetric matrix of :func:`hvd_dssync.sensing.decide_racks` with the pairs inside one of its racks and
    ``inf`` for the pairs across them (to be timed again), or ``None`` (time every pair) where it found no
    racks or timed other hosts. The watch that asks for a sensing again sees only the averages across the
    racks (:mod:`hvd_dssync.resense`), so those pairs are what moved.

    Example::

        >>> before = Sensed("measured", [[0, 1], [2, 3]], hosts=4,
        ...                 seconds_by_pair={"0-1": .01, "0-2": .1, "0-3": .1, "1-2": .1, "1-3": .1, "2-3": .01})
        >>> known_figures(before, [0, 1, 2, 3])[0].tolist()
        [0.0, 0.01, inf, inf]
        >>> known_figures(Sensed("measured", None, hosts=4, seconds_by_pair={}), [0, 1, 2, 3]) is None
        True
    """
    if previous is None or previous.racks is None or not previous.seconds_by_pair:
        return None
    known_leaders, seconds = seconds_of_pairs(previous.seconds_by_pair)
    if known_leaders != list(leaders):
        return None
    rack_of = {r: k for k, rack in enumerate(previous.racks) for r in rack}
    if any(r not in rack_of for r in leaders):
        return None
    racks = np.array([rack_of[r] for r in leaders])
    seconds = seconds.copy()
    seconds[racks[:, None] != racks[None, :]] = math.inf
    return seconds


def sense_once(key, run, rank=0):
    """The process's :class:`Sensed` for the Horovod world ``key``, from ``run()`` the first time only (every
    rank of a job builds its first optimizer alike, so every rank probes or none does). Logs one line on
    rank 0. No communication after the first time.

    Example::

        >>> sense_once(("doc", 1), lambda: Sensed("one host", None)) is sense_once(("doc", 1), None)
        True
    """
    if key not in _cache:
        sensed = run()
        _cache.clear()
        _cache[key] = sensed
        if rank == 0:
            log.info(sensed.describe())
    return _cache[key]


def last_sensed():
    """The :class:`Sensed` of this process's job, or ``None`` where no optimizer sensed anything yet.

    Example::

        >>> last_sensed() is None or isinstance(last_sensed(), Sensed)
        True
    """
    return next(iter(_cache.values()), None)


def default_topology(hvd, allgather_rows, hosts_op_name, schedule, num_groups, group_size, topology,
                     schedule_options, whole_job):
    """An optimizer's ``topology`` as both adapters resolve it: ``(topology, Sensed or None)``.

    "auto" becomes the sensed racks (a Topology), or ``None`` where there is one rack or nothing to sense
    (:func:`wants_sensing`); any other value is returned as it is. ``hvd`` is the framework's Horovod module;
    ``allgather_rows(row)`` allgathers a float64 row in that framework; ``hosts_op_name`` names the host-name
    allgather. A collective the first time a process senses (:func:`sense_once`).

    Example::

        topology, sensed = default_topology(hvd, allgather_rows, "dssync.sense.hosts", None, None, None,
                                            "auto", None, whole_job=True)
    """
    if not (isinstance(topology, str) and topology == AUTO):
        return topology, None
    dynamic = os.environ.get(DYNAMIC_ENV, "0") not in ("0", "")
    if not wants_sensing(schedule, num_groups, group_size, topology, schedule_options, os.environ.get(TOPOLOGY_ENV),
                         whole_job, elastic_job(), dynamic):
        return None, None

    sensed = sense_once(_job_key(hvd), lambda: _sense_job(hvd, allgather_rows, hosts_op_name), hvd.rank())
    return sensed.topology(), sensed


def sense_again(hvd, allgather_rows, hosts_op_name, previous=None):
    """Sense the job's racks anew (the network changed: :mod:`hvd_dssync.resense`), as
    :func:`default_topology` did, timing only the pairs across the racks of ``previous`` (the
    :class:`Sensed` in force: :func:`known_figures`), and keep the result as the process's
    (:func:`last_sensed`); a collective on every rank. Logs one line on rank 0. Returns the :class:`Sensed`.

    Example::

        sensed = sense_again(hvd, allgather_rows, "dssync.sense.hosts", previous=sensed)
    """
    sensed = _sense_job(hvd, allgather_rows, hosts_op_name, previous)
    _cache.clear()
    _cache[_job_key(hvd)] = sensed
    if hvd.rank() == 0:
        log.info(sensed.describe().replace("sensed", "sensed again", 1))
    return sensed


def _job_key(hvd):
    return hvd.size(), hvd.rank(), hvd.local_size(), hvd.cross_size()


def _sense_job(hvd, allgather_rows, hosts_op_name, previous=None):
    return sense(hvd.rank(), hvd.size(), hvd.local_size() == hvd.size(),
                 lambda mine: hvd.allgather_object(mine, name=hosts_op_name), allgather_rows, previous=previous)
