"""What the default schedule senses of the network when the optimizer is built (``topology="auto"``).

Without DS-Sync arguments, ``DistributedOptimizer`` looks for racks once per process, before the ranks'
agreement check, and averages in the topology-aware schedule on them where it finds two or more (else
today's default, random groups):

1. **One host** (Horovod's ``local_size() == size()``, every rank on one machine, as in ``make test``):
   nothing to find and nothing sent; the default is unchanged.
2. **Hosts**: one allgather of the hostnames (:func:`hvd_dssync.topology.host_name`). Where the job spans
   several hosts that each run several ranks, each host is a rack (:func:`layout`).
3. **Measured**: where that says nothing (a host with one rank, as on the bench: one rank per emulated
   host), the lowest rank of each host times an allreduce with every other host's, in round-robin rounds
   of disjoint pairs, on two-rank process sets registered once for the whole probe (:func:`probe_groups`)
   and removed once after it (Horovod's Gloo controller is sensitive to sets added and removed while it
   runs); then ONE allgather of every rank's figures, from which every rank builds the same racks
   (:func:`racks_from_figures`: slow links below ``slow_fraction`` of the fastest pair's rate).

The result is a :class:`Sensed` (how, what was found, what it cost), kept per process (:func:`sense_once`),
so a later optimizer of the same job probes nothing. Numpy only: the adapters supply the collectives.
"""
import logging
import math
import time

import numpy as np

from .topology import Topology, racks_from_rates, round_robin_pairings

__all__ = ["AUTO", "Sensed", "layout", "probe_groups", "measure", "racks_from_figures", "sense", "sense_once",
           "last_sensed", "wants_sensing", "SENSE_NBYTES", "SENSE_REPEATS", "MAX_PROBED_HOSTS"]

AUTO = "auto"  # the adapters' default ``topology=``: sense the racks when the optimizer is built
SENSE_NBYTES = 524288  # bytes of each timed allreduce of the probe
SENSE_REPEATS = 2  # timed allreduces per pair (after an unmeasured one); the fastest counts
MAX_PROBED_HOSTS = 16  # more hosts than this are not probed (n (n - 1) / 2 process sets): pass the racks

log = logging.getLogger("hvd_dssync")

_cache = {}


class Sensed:
    """What sensing found: ``how`` ("one host", "hosts", "measured", or "not probed": too many hosts), the ``racks`` (lists of ranks; ``None``
    for one rack), its cost in ``seconds``, the number of ``hosts`` and, when measured, the host pairs timed.

    Example::

        >>> s = Sensed("hosts", [[0, 1], [2, 3]], seconds=0.01, hosts=2)
        >>> s.found, s.topology().rack_ranks()
        ('2 racks', [[0, 1], [2, 3]])
        >>> Sensed("one host", None).to_dict()["found"]
        'one rack'
    """

    def __init__(self, how, racks, seconds=0.0, hosts=1, pairs=0, seconds_by_pair=None):
        self.how = how
        self.racks = [list(r) for r in racks] if racks is not None and len(racks) > 1 else None
        self.seconds = float(seconds)
        self.hosts = int(hosts)
        self.pairs = int(pairs)
        self.seconds_by_pair = seconds_by_pair

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
            out["seconds_by_pair"] = self.seconds_by_pair
        return out

    def describe(self):
        racks = "" if self.racks is None else f" {self.racks}"
        return (f"hvd_dssync: sensed {self.found}{racks} ({self.how}, {self.hosts} host(s)"
                + (f", {self.pairs} pairs timed" if self.pairs else "") + f") in {self.seconds:.3f} s")

    def __repr__(self):
        return f"Sensed(how={self.how!r}, racks={self.racks}, seconds={self.seconds:.3f})"


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
    return (isinstance(topology, str) and topology == AUTO and schedule is None and num_groups is None
            and group_size is None and schedule_options is None and not environ_topology and whole_job
            and not elastic and dynamic_sets)


def layout(rank_hosts):
    """What Horovod's host layout says: ``("one host", None)``, ``("hosts", racks)`` where every one of
    several hosts runs several ranks (a rack per host), else ``("measure", leaders)``: the lowest rank of
    each host, in the order of the hosts' first ranks.

    Example::

        >>> layout(["a", "a", "a"])
        ('one host', None)
        >>> layout(["a", "b", "a", "b"])
        ('hosts', [[0, 2], [1, 3]])
        >>> layout(["a", "b", "c", "d"])
        ('measure', [0, 1, 2, 3])
        >>> layout(["a", "a", "b"])
        ('measure', [0, 2])
    """
    hosts = list(dict.fromkeys(rank_hosts))
    if len(hosts) == 1:
        return "one host", None
    ranks = [[r for r, h in enumerate(rank_hosts) if h == host] for host in hosts]
    if all(len(r) > 1 for r in ranks):
        return "hosts", sorted(ranks)
    return "measure", [r[0] for r in ranks]


def probe_groups(leaders):
    """The probe's rounds of disjoint pairs of ``leaders`` (every pair once) and the pair groups to register,
    sorted: all of them at once, once for the whole probe.

    Example::

        >>> rounds, groups = probe_groups([0, 2, 4])
        >>> rounds
        [[(2, 4)], [(0, 4)], [(0, 2)]]
        >>> groups
        [(0, 2), (0, 4), (2, 4)]
    """
    rounds = [[(leaders[a], leaders[b]) for a, b in pairs] for pairs in round_robin_pairings(len(leaders))]
    return rounds, sorted(g for pairs in rounds for g in pairs)


def measure(rank, leaders, registry, time_allreduce, repeats=SENSE_REPEATS):
    """This rank's figures: the fastest of ``repeats`` timed allreduces with each host leader it is paired
    with (after an unmeasured one that meets the partner), by host index; NaN elsewhere.

    ``registry`` is the job's :class:`hvd_dssync.process_sets.ProcessSetRegistry`; the pair groups are
    acquired once before the rounds and released once after them (collectives, on every rank).
    ``time_allreduce(process_set, name, warm)`` runs one blocking allreduce on the set and returns its
    seconds (``warm``: the unmeasured one, which may carry one element). The pairs of a round run at the
    same time; a rank in no pair of a round (an odd number of hosts, or not a host's first rank) waits.

    Example::

        >>> class Registry:
        ...     def acquire(self, groups): print("acquire", groups)
        ...     def release(self, groups): print("release", groups)
        ...     def get(self, group): return group
        >>> measure(0, [0, 1, 2], Registry(), lambda ps, name, warm: 0.5 if ps == (0, 2) else 0.1).tolist()
        acquire [(0, 1), (0, 2), (1, 2)]
        release [(0, 1), (0, 2), (1, 2)]
        [nan, 0.1, 0.5]
    """
    rounds, groups = probe_groups(leaders)
    index = {r: i for i, r in enumerate(leaders)}
    row = np.full(len(leaders), np.nan)
    registry.acquire(groups)
    for pairs in rounds:
        for a, b in pairs:
            if rank not in (a, b):
                continue
            process_set = registry.get((a, b))
            name = f"dssync.sense.{a}.{b}"
            time_allreduce(process_set, name + ".warm", True)
            row[index[b if rank == a else a]] = min(time_allreduce(process_set, name, False)
                                                    for _ in range(repeats))
    registry.release(groups)
    return row


def racks_from_figures(gathered, leaders, rank_hosts, slow_fraction=0.5):
    """The racks (lists of ranks) from every rank's figures, the rows of ONE allgather: the same on every
    rank. A pair's seconds are the larger of its two ends' (both timed the same allreduces); hosts joined by
    links of at least ``slow_fraction`` of the fastest pair's rate form a rack
    (:func:`hvd_dssync.topology.racks_from_rates`). Also returns ``{"a-b": seconds}`` by leader ranks.

    Example::

        >>> nan = float("nan")
        >>> rows = [[nan, .01, .1, .1], [.01, nan, .1, .1], [.1, .1, nan, .01], [.1, .1, .02, nan]]
        >>> racks_from_figures(rows, [0, 1, 2, 3], ["a", "b", "c", "d"])[0]
        [[0, 1], [2, 3]]
    """
    gathered = np.asarray(gathered, dtype=float)
    n = len(leaders)
    seconds = np.zeros((n, n))
    by_pair = {}
    for a in range(n):
        for b in range(a + 1, n):
            ends = [gathered[leaders[a], b], gathered[leaders[b], a]]
            ends = [s for s in ends if not math.isnan(s)]
            seconds[a, b] = seconds[b, a] = max(ends) if ends else math.inf
            by_pair[f"{leaders[a]}-{leaders[b]}"] = round(float(seconds[a, b]), 6)
    rates = [[0.0 if i == j else 1.0 / max(seconds[i, j], 1e-9) for j in range(n)] for i in range(n)]
    host_racks = racks_from_rates(rates, slow_fraction)
    host_of_leader = [rank_hosts[r] for r in leaders]
    rack_of_host = {host_of_leader[h]: k for k, rack in enumerate(host_racks) for h in rack}
    racks = {}
    for rank, host in enumerate(rank_hosts):
        racks.setdefault(rack_of_host[host], []).append(rank)
    return sorted(racks.values()), by_pair


def sense(rank, world_size, one_host, gather_hostnames, registry, time_allreduce, allgather,
          repeats=SENSE_REPEATS, slow_fraction=0.5, clock=time.perf_counter):
    """Sense the racks (see the module's docstring); a collective with the same op sequence on every rank.

    ``one_host``: Horovod says every rank is on this host (then nothing is sent); ``gather_hostnames()``:
    every rank's :func:`~hvd_dssync.topology.host_name`, by rank; ``allgather(row)``: every rank's figures
    row (a float64 vector), stacked by rank; ``registry`` and ``time_allreduce`` as in :func:`measure`.
    More than :data:`MAX_PROBED_HOSTS` hosts with one rank among them are not probed (one rack).

    Example::

        >>> sense(0, 4, True, None, None, None, None).to_dict()["how"]
        'one host'
        >>> sense(0, 4, False, lambda: ["a", "a", "b", "b"], None, None, None).racks
        [[0, 1], [2, 3]]
    """
    started = clock()
    if world_size == 1 or one_host:
        return Sensed("one host", None, clock() - started)
    rank_hosts = list(gather_hostnames())
    how, found = layout(rank_hosts)
    hosts = len(set(rank_hosts))
    if how != "measure":
        return Sensed(how, found, clock() - started, hosts)
    leaders = found
    if len(leaders) > MAX_PROBED_HOSTS:
        return Sensed("not probed", None, clock() - started, hosts)
    row = measure(rank, leaders, registry, time_allreduce, repeats)
    gathered = allgather(row)
    racks, by_pair = racks_from_figures(gathered, leaders, rank_hosts, slow_fraction)
    return Sensed("measured", racks, clock() - started, hosts, len(by_pair), by_pair)


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
