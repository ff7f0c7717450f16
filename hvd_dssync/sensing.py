"""What the default schedule senses of the network when the optimizer is built (``topology="auto"``).

Without DS-Sync arguments, ``DistributedOptimizer`` looks for racks once per process, before the ranks'
agreement check, and averages in the topology-aware schedule on them where it finds two or more (else
today's default, random groups):

1. **One host** (Horovod's ``local_size() == size()``, every rank on one machine, as in ``make test``):
   nothing to find and nothing sent; the default is unchanged.
2. **Hosts**: one allgather of the hostnames (:func:`hvd_dssync.topology.host_name`). Where the job spans
   two hosts that each run several ranks, each host is a rack (:func:`layout`).
3. **Measured**: where that says nothing or not all (a host with one rank, as on the bench's one rank per
   emulated host; or three hosts and more, which may share uplinks), the first rank of each host sends up
   to ``SENSE_NBYTES`` (for at most ``SENSE_CAP_SECONDS``) to every other host's over TCP, in round-robin
   rounds of disjoint pairs (:class:`PairProbe`: a listener on the address Horovod's Gloo uses, its
   endpoint gathered with the host names). Plain sockets, not Horovod: no process set is registered
   (Horovod's Gloo controller is sensitive to sets added and removed while it runs), and a transfer's time
   is the link's, not Horovod's negotiation. Then ONE allgather of every rank's figures, from which every
   rank builds the same racks (:func:`racks_from_figures`: slow links below ``slow_fraction`` of the
   fastest pair's rate). Hosts that each run several ranks and turn out to share one flat network are each
   a rack, as in 2.

The result is a :class:`Sensed` (how, what was found, what it cost), kept per process (:func:`sense_once`),
so a later optimizer of the same job probes nothing. Where the racks were measured, the optimizer watches
the averages that cross the network and senses again when their cost moves (:mod:`hvd_dssync.resense`).
Numpy only: the adapters supply the collectives.
"""
import logging
import math
import os
import socket
import time

import numpy as np

from .process_sets import DYNAMIC_ENV, elastic_job
from .topology import ENV_VAR as TOPOLOGY_ENV, Topology, host_name, racks_from_rates, round_robin_pairings

__all__ = ["AUTO", "Sensed", "layout", "host_racks", "probe_rounds", "local_address", "PairProbe", "measure", "racks_from_figures",
           "sense", "sense_once", "last_sensed", "wants_sensing", "SENSE_NBYTES", "SENSE_REPEATS",
           "SENSE_CAP_SECONDS", "MAX_PROBED_HOSTS", "default_topology", "sense_again"]

AUTO = "auto"  # the adapters' default ``topology=``: sense the racks when the optimizer is built
SENSE_NBYTES = 524288  # bytes of each timed transfer of the probe, at most (see SENSE_CAP_SECONDS)
SENSE_REPEATS = 2  # timed transfers per pair (after an unmeasured exchange); the fastest counts
SENSE_CAP_SECONDS = 0.005  # a transfer stops sending after this long: slow links cost little to tell
SENSE_CHUNK = 16384  # bytes sent at a time (each after a 4-byte length; a zero length ends the transfer)
# The sender's socket buffer: what a capped transfer leaves in flight to drain after SENSE_CAP_SECONDS (the
# kernel's own buffer grows to megabytes, which a slow link then takes a second to carry, times the pairs
# that share it); at least a fast link's bandwidth-delay product (64 KB in flight, as Linux doubles it,
# fills 25 Gbit/s at a 20 us round trip).
SENSE_SEND_BUFFER = 32768
MAX_PROBED_HOSTS = 16  # more hosts than this are not probed (n (n - 1) / 2 pairs): pass the racks

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


def probe_rounds(leaders):
    """The probe's rounds of disjoint pairs of ``leaders``, every pair once (circle method).

    Example::

        >>> probe_rounds([0, 2, 4])
        [[(2, 4)], [(0, 4)], [(0, 2)]]
    """
    return [[(leaders[a], leaders[b]) for a, b in pairs] for pairs in round_robin_pairings(len(leaders))]


def local_address(environ=None):
    """The IPv4 address other hosts reach this rank at, or ``None``: that of ``HOROVOD_GLOO_IFACE`` (the
    interface Horovod's Gloo uses), else the one that routes to ``HOROVOD_GLOO_RENDEZVOUS_ADDR``, else the
    host name's; a loopback address reaches no other host (``None``).

    Example::

        >>> local_address({"HOROVOD_GLOO_IFACE": "lo"}) is None   # loopback: no other host reaches it
        True
    """
    environ = os.environ if environ is None else environ
    candidates = []
    iface = (environ.get("HOROVOD_GLOO_IFACE") or "").split(",")[0].strip()
    if iface:
        candidates.append(lambda: _iface_address(iface))
    rendezvous = environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if rendezvous:
        candidates.append(lambda: _route_address(rendezvous))
    candidates.append(lambda: socket.gethostbyname(host_name()))
    for candidate in candidates:
        try:
            address = candidate()
        except OSError:
            continue
        if address and not address.startswith("127."):
            return address
        if iface:
            return None  # Horovod's own interface is loopback: the job is on one host as far as it knows
    return None


def _iface_address(name):
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


def _route_address(target):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))
        return s.getsockname()[0]


class PairProbe:
    """This rank's end of the probe: a TCP listener on ``address`` (bound when built), and the timed
    transfers with the partners of :func:`measure`. Plain sockets, not Horovod: no process set is
    registered, and a transfer's time is the link's, not Horovod's negotiation of every registered set.
    """

    def __init__(self, address, timeout=30.0):
        self.timeout = timeout
        self.listener = None
        self._pending = {}
        if address is not None:
            try:
                self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self.listener.bind((address, 0))
                self.listener.listen(64)
                self.listener.settimeout(timeout)
            except OSError as error:  # no endpoint: every rank sees it in the gathered endpoints
                log.warning(f"hvd_dssync: sensing cannot listen on {address}: {error}")
                self.close()

    def endpoint(self):
        return None if self.listener is None else list(self.listener.getsockname()[:2])

    def close(self):
        for conn in self._pending.values():
            conn.close()
        self._pending.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def _accept_from(self, partner):
        """The connection of ``partner`` (connections of later rounds' partners wait their turn)."""
        while partner not in self._pending:
            conn, _ = self.listener.accept()
            conn.settimeout(self.timeout)
            self._pending[int.from_bytes(_read(conn, 4), "big")] = conn
        return self._pending.pop(partner)

    def client(self, rank, endpoint, nbytes, repeats, cap_seconds=SENSE_CAP_SECONDS):
        """Send ``repeats`` transfers of up to ``nbytes`` to the partner at ``endpoint``, after one unmeasured
        exchange that meets it; the fastest transfer's seconds (until the partner acknowledged its last byte),
        scaled to ``nbytes``.

        A transfer stops sending once ``cap_seconds`` have passed (at least one chunk is sent): a fast link
        carries all ``nbytes`` before that, a slow one is timed on what it carried, so a slow link costs
        about ``cap_seconds`` (plus what the socket still holds, at most :data:`SENSE_SEND_BUFFER` and its
        kernel's share) instead of ``nbytes`` at its own rate.
        """
        payload = memoryview(bytes(SENSE_CHUNK))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SENSE_SEND_BUFFER)
            conn.settimeout(self.timeout)
            conn.connect(tuple(endpoint))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(rank.to_bytes(4, "big"))
            conn.sendall(b"w")
            _read(conn, 1)
            fastest = math.inf
            for _ in range(repeats):
                started = time.perf_counter()
                sent = 0
                while sent < nbytes and (sent == 0 or time.perf_counter() - started < cap_seconds):
                    n = min(SENSE_CHUNK, nbytes - sent)
                    conn.sendall(n.to_bytes(4, "big"))
                    conn.sendall(payload[:n])
                    sent += n
                conn.sendall((0).to_bytes(4, "big"))
                _read(conn, 1)
                fastest = min(fastest, (time.perf_counter() - started) * nbytes / sent)
        return fastest

    def server(self, partner, nbytes, repeats):
        conn = self._accept_from(partner)
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _read(conn, 1)
            conn.sendall(b"a")
            for _ in range(repeats):
                while True:
                    n = int.from_bytes(_read(conn, 4), "big")
                    if n == 0:
                        break
                    _read(conn, n)
                conn.sendall(b"a")


def _read(conn, n):
    view, got = bytearray(n), 0
    while got < n:
        chunk = conn.recv_into(memoryview(view)[got:], n - got)
        if not chunk:
            raise ConnectionError("the partner closed the connection")
        got += chunk
    return bytes(view)


def measure(rank, leaders, endpoints, probe, nbytes=SENSE_NBYTES, repeats=SENSE_REPEATS):
    """This rank's figures: the fastest of ``repeats`` timed transfers of ``nbytes`` to each host leader it
    is paired with (the pair's lower rank sends, the other acknowledges), by host index; NaN elsewhere,
    and where a transfer failed (then every rank finds a figure missing and nobody uses the probe).

    The pairs of a round run at the same time; a rank meets its next partner as soon as it is done with
    the last one (no barrier between rounds). ``endpoints`` are every rank's ``PairProbe.endpoint()``,
    ``probe`` this rank's :class:`PairProbe`.

    Example::

        >>> class Probe:
        ...     def client(self, rank, endpoint, nbytes, repeats): return 0.5 if endpoint == "e2" else 0.1
        ...     def server(self, partner, nbytes, repeats): pass
        >>> measure(0, [0, 1, 2], ["e0", "e1", "e2"], Probe()).tolist()
        [nan, 0.1, 0.5]
    """
    index = {r: i for i, r in enumerate(leaders)}
    row = np.full(len(leaders), np.nan)
    for pairs in probe_rounds(leaders):
        for a, b in pairs:
            if rank not in (a, b):
                continue
            try:
                if rank == a:
                    row[index[b]] = probe.client(rank, endpoints[b], nbytes, repeats)
                else:
                    probe.server(a, nbytes, repeats)
            except OSError as error:
                log.warning(f"hvd_dssync: sensing could not time the link between ranks {a} and {b}: {error}")
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


def sense(rank, world_size, one_host, allgather_object, allgather, nbytes=SENSE_NBYTES, repeats=SENSE_REPEATS,
          slow_fraction=0.5, clock=time.perf_counter, address=local_address, probe_class=PairProbe):
    """Sense the racks (see the module's docstring); a collective with the same op sequence on every rank.

    ``one_host``: Horovod says every rank is on this host (then nothing is sent);
    ``allgather_object(obj)``: every rank's object, by rank (one allgather of each rank's host name and
    probe endpoint); ``allgather(row)``: every rank's figures row (a float64 vector), stacked by rank.
    Where some host's first rank has no address other hosts reach, more than :data:`MAX_PROBED_HOSTS` hosts
    would be probed, or a pair could not be timed, nothing is measured ("not probed": one rack).

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
        rank_hosts = [h for h, _ in gathered]
        endpoints = [e for _, e in gathered]
        how, found = layout(rank_hosts)
        hosts = len(set(rank_hosts))
        if how != "measure":
            return Sensed(how, found, clock() - started, hosts)
        leaders = found
        by_host = host_racks(rank_hosts)  # where the links between the hosts say nothing more
        if len(leaders) > MAX_PROBED_HOSTS or any(endpoints[r] is None for r in leaders):
            how = "not probed" if by_host is None else "hosts"
            return Sensed(how, by_host, clock() - started, hosts)
        row = measure(rank, leaders, endpoints, probe, nbytes, repeats)
    finally:
        probe.close()
    figures = np.asarray(allgather(row), dtype=float)
    racks, by_pair = racks_from_figures(figures, leaders, rank_hosts, slow_fraction)
    if any(math.isinf(v) for v in by_pair.values()):
        how = "not probed" if by_host is None else "hosts"
        return Sensed(how, by_host, clock() - started, hosts, len(by_pair), by_pair)
    if len(racks) < 2 and by_host is not None:  # hosts on a flat network: each host is a rack
        return Sensed("hosts", by_host, clock() - started, hosts, len(by_pair), by_pair)
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


def sense_again(hvd, allgather_rows, hosts_op_name):
    """Sense the job's racks anew (the network changed: :mod:`hvd_dssync.resense`), as
    :func:`default_topology` did, and keep the result as the process's (:func:`last_sensed`); a collective
    on every rank. Logs one line on rank 0. Returns the :class:`Sensed`.

    Example::

        sensed = sense_again(hvd, allgather_rows, "dssync.sense.hosts")
    """
    sensed = _sense_job(hvd, allgather_rows, hosts_op_name)
    _cache.clear()
    _cache[_job_key(hvd)] = sensed
    if hvd.rank() == 0:
        log.info(sensed.describe().replace("sensed", "sensed again", 1))
    return sensed


def _job_key(hvd):
    return hvd.size(), hvd.rank(), hvd.local_size(), hvd.cross_size()


def _sense_job(hvd, allgather_rows, hosts_op_name):
    return sense(hvd.rank(), hvd.size(), hvd.local_size() == hvd.size(),
                 lambda mine: hvd.allgather_object(mine, name=hosts_op_name), allgather_rows)
