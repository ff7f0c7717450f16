"""Hosts, racks and slow links: what a network-aware schedule needs to know.

A :class:`Topology` maps every rank to a host and every host to a rack. Links inside a rack are fast;
links between racks are slow unless said otherwise, at ``cross_rack_gbps`` (used by the simulator).
Hosts are discovered from Horovod (one allgather of the hostname, in the adapters); racks are declared
by the user: an argument, a JSON file, or the ``HVD_DSSYNC_TOPOLOGY`` environment variable.

Spec forms accepted by :func:`Topology.parse`::

    [[0, 1], [2, 3]]                              # racks as lists of ranks
    {"racks": [["host-a", "host-b"], ["host-c"]]}  # racks as lists of hostnames
    {"racks": [[0, 1], [2, 3]], "intra_rack_gbps": 10, "cross_rack_gbps": 1}
    "path/to/topology.json" or the same JSON as a string
"""
import json
import os
import socket

__all__ = ["Topology", "ENV_VAR", "loopback_hostname_warning", "job_topology", "round_robin_pairings",
           "host_name"]

ENV_VAR = "HVD_DSSYNC_TOPOLOGY"


class Topology:
    """Rank to host to rack, and the link rates between them.

    Args:
        rank_hosts: the host name of each rank, indexed by rank.
        host_racks: the rack index of each host (a dict); a host not named gets a rack of its own.
        intra_rack_gbps: rate of links inside a rack (per host), for the simulator.
        cross_rack_gbps: rate of the links between racks, for the simulator.

    Example::

        >>> t = Topology.from_racks([[0, 1], [2, 3]])
        >>> t.rack_ranks(), t.is_slow(0, 2), t.is_slow(0, 1)
        ([[0, 1], [2, 3]], True, False)
    """

    def __init__(self, rank_hosts, host_racks=None, intra_rack_gbps=10.0, cross_rack_gbps=1.0):
        if not rank_hosts:
            raise ValueError("a topology needs at least one rank")
        self.rank_hosts = [str(h) for h in rank_hosts]
        hosts = list(dict.fromkeys(self.rank_hosts))
        host_racks = dict(host_racks or {})
        unknown = sorted(set(host_racks) - set(hosts))
        if unknown:
            raise ValueError(f"topology names hosts that run no rank: {unknown}; the job's hosts are {hosts}")
        next_rack = max(host_racks.values(), default=-1) + 1
        for host in hosts:
            if host not in host_racks:
                host_racks[host] = next_rack
                next_rack += 1
        self.host_racks = host_racks
        for name, value in (("intra_rack_gbps", intra_rack_gbps), ("cross_rack_gbps", cross_rack_gbps)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"topology ``{name}`` must be a positive number, got {value!r}")
        self.intra_rack_gbps = float(intra_rack_gbps)
        self.cross_rack_gbps = float(cross_rack_gbps)

    @classmethod
    def from_racks(cls, racks, **rates):
        """Racks given as lists of ranks; each rank is its own host."""
        ranks = [r for rack in racks for r in rack]
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                raise ValueError(f"topology racks must list integer ranks, got {r!r}")
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"topology racks must name each rank 0..{len(ranks) - 1} exactly once, got {racks}")
        hosts = [None] * len(ranks)
        host_racks = {}
        for rack_index, rack in enumerate(racks):
            for r in rack:
                hosts[r] = f"rank{r}"
                host_racks[f"rank{r}"] = rack_index
        return cls(hosts, host_racks, **rates)

    @classmethod
    def parse(cls, spec, rank_hosts=None):
        """Build from a spec (see the module docstring); ``rank_hosts`` resolves racks of hostnames."""
        if isinstance(spec, Topology):
            return spec
        if isinstance(spec, str):
            text = open(spec).read() if os.path.exists(spec) else spec
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"topology spec is neither a file nor valid JSON: {spec!r} ({e})") from None
        if isinstance(spec, list):
            spec = {"racks": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("racks"), list):
            raise ValueError(f"topology spec must be a list of racks or a dict with 'racks', got {spec!r}")
        unknown = sorted(set(spec) - {"racks", "intra_rack_gbps", "cross_rack_gbps"})
        if unknown:
            raise ValueError(f"topology spec has unknown keys {unknown}")
        rates = {k: spec[k] for k in ("intra_rack_gbps", "cross_rack_gbps") if k in spec}
        racks = spec["racks"]
        if all(isinstance(r, int) and not isinstance(r, bool) for rack in racks for r in rack):
            topology = cls.from_racks(racks, **rates)
            if rank_hosts is not None and len(rank_hosts) != topology.world_size:
                raise ValueError(f"topology names {topology.world_size} ranks, but the job has {len(rank_hosts)}")
            return topology
        if rank_hosts is None:
            raise ValueError("a topology of hostnames needs the job's hosts (rank_hosts)")
        host_racks = {}
        for rack_index, rack in enumerate(racks):
            for host in rack:
                if host in host_racks:
                    raise ValueError(f"topology puts host {host!r} in more than one rack")
                host_racks[host] = rack_index
        return cls(rank_hosts, host_racks, **rates)

    @classmethod
    def from_env(cls, rank_hosts):
        """The topology named by ``HVD_DSSYNC_TOPOLOGY``, or one rack per host when it is unset."""
        spec = os.environ.get(ENV_VAR)
        if spec:
            return cls.parse(spec, rank_hosts)
        return cls(rank_hosts)

    @property
    def world_size(self):
        return len(self.rank_hosts)

    @property
    def num_racks(self):
        return len(set(self.host_racks.values()))

    def rack_of(self, rank):
        return self.host_racks[self.rank_hosts[rank]]

    def rack_ranks(self):
        """Ranks of each rack, racks in order of their smallest rank."""
        racks = {}
        for rank in range(self.world_size):
            racks.setdefault(self.rack_of(rank), []).append(rank)
        return sorted(racks.values())

    def is_slow(self, a, b):
        """Whether traffic between ranks ``a`` and ``b`` crosses a slow (inter-rack) link."""
        return self.rack_of(a) != self.rack_of(b)

    def to_dict(self):
        return {"racks": self.rack_ranks(), "intra_rack_gbps": self.intra_rack_gbps,
                "cross_rack_gbps": self.cross_rack_gbps}

    def __eq__(self, other):
        return isinstance(other, Topology) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"Topology(racks={self.rack_ranks()})"


def loopback_hostname_warning(cross_size):
    """The warning for a multi-host job whose hostname resolves to loopback, or ``None``.

    Horovod 0.28.1 as released builds a process set's Gloo context from the address the hostname
    resolves to and ignores ``HOROVOD_GLOO_IFACE``, so on such hosts (Debian's default /etc/hosts) the
    ranks of other hosts would try to reach 127.x and abort. hvd_dssync's set-up builds Horovod with the
    fix; other builds need the hostname mapped to the host's address.

    Example::

        >>> loopback_hostname_warning(cross_size=1) is None   # one host: loopback is fine
        True
    """
    if cross_size <= 1:
        return None
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    if not address.startswith("127."):
        return None
    return (f"hvd_dssync: this job spans {cross_size} hosts but the hostname {socket.gethostname()!r} resolves "
            f"to {address}. Unless Horovod was built with hvd_dssync's Gloo fix (scripts/setup.sh does it), "
            "process sets' Gloo contexts ignore HOROVOD_GLOO_IFACE and bind to that loopback address, and "
            "ranks on other hosts cannot reach them. Map the hostname to this host's network address in "
            "/etc/hosts (in a network namespace NAME: /etc/netns/NAME/hosts).")


def job_topology(spec, world_size, gather_hostnames):
    """The job's topology: each rank's host from ``gather_hostnames()``, racks from ``spec``.

    ``spec`` is a Topology, a JSON file or string, or racks as lists of ranks or hostnames; without it,
    ``HVD_DSSYNC_TOPOLOGY`` is read, else every host is its own rack. ``gather_hostnames`` is the
    adapter's allgather of ``socket.gethostname()`` (a collective, called unless ``spec`` is a Topology).

    Example::

        >>> job_topology([[0, 1], [2, 3]], 4, lambda: ["a", "a", "b", "b"]).rack_ranks()
        [[0, 1], [2, 3]]
    """
    if isinstance(spec, Topology):
        if spec.world_size != world_size:
            raise ValueError(f"Arg ``topology`` names {spec.world_size} ranks, but the job has {world_size}.")
        return spec
    hosts = gather_hostnames()
    return Topology.from_env(hosts) if spec is None else Topology.parse(spec, hosts)


def host_name():
    """This process's host as Horovod names it: ``HOROVOD_HOSTNAME`` (set by horovodrun and by the
    emulated cluster, whose namespaces share one kernel hostname), else the kernel's hostname.

    Example::

        >>> host_name() == (os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())
        True
    """
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def round_robin_pairings(n):
    """Rounds of disjoint pairs such that every pair of ``0 .. n-1`` meets exactly once (circle method).

    With an odd ``n`` one member sits out each round.

    Example::

        >>> round_robin_pairings(4)
        [[(0, 3), (1, 2)], [(0, 2), (1, 3)], [(0, 1), (2, 3)]]
    """
    players = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(len(players) - 1):
        half = len(players) // 2
        pairs = [(players[i], players[-1 - i]) for i in range(half)]
        rounds.append(sorted(tuple(sorted(p)) for p in pairs if None not in p))
        players = [players[0], players[-1]] + players[1:-1]
    return rounds
