"""The probe: timed TCP transfers between the hosts' first ranks, in rounds of disjoint pairs.

Plain sockets, not Horovod: no process set is registered (Horovod's Gloo controller is sensitive to sets
added and removed while it runs), and a transfer's time is the link's, not Horovod's negotiation. Each
rank listens on the address Horovod's Gloo uses (:func:`local_address`); its endpoint is gathered with the
host names (:mod:`hvd_dssync.sensing.job`). Numpy only.
"""
import logging
import math
import os
import socket
import time

import numpy as np

from ..topology import host_name, round_robin_pairings

__all__ = ["probe_rounds", "pair_rounds", "local_address", "PairProbe", "measure", "SENSE_NBYTES", "SENSE_REPEATS",
           "SENSE_CAP_SECONDS", "SENSE_TARGET_SECONDS", "SENSE_MAX_NBYTES", "SENSE_CHUNK", "SENSE_SEND_BUFFER"]

SENSE_NBYTES = 524288  # the unit of the figures: seconds of a transfer of this many bytes (see PairProbe.client)
SENSE_REPEATS = 3  # timed transfers per pair (after an unmeasured one that sizes them); the fastest counts
SENSE_CAP_SECONDS = 0.005  # a transfer stops sending after this long: slow links cost little to tell
# A timed transfer is sized from the first (unmeasured) transfer's rate to last about this long: a fast
# link is timed over milliseconds, not over the tens of microseconds SENSE_NBYTES takes a 100 Gbit/s NIC,
# which software noise would time instead.
SENSE_TARGET_SECONDS = 0.004
SENSE_MAX_NBYTES = 1 << 26  # the largest timed transfer (64 MB: 4 ms at 134 Gbit/s)
SENSE_CHUNK = 16384  # bytes sent at a time at first (each after a 4-byte length; a zero length ends a transfer)
# The timed transfers' chunks: about an eighth of SENSE_CAP_SECONDS at the first transfer's rate, within
# [SENSE_CHUNK, SENSE_MAX_CHUNK]. On a fast link, fewer and larger sends leave the CPU to the link (on hosts
# whose cores are busy, a pair's sends and reads timed the CPU instead); on a slow one, a chunk is short
# enough not to overshoot the cap.
SENSE_MAX_CHUNK = 1 << 20
# The sender's socket buffer: what a capped transfer leaves in flight to drain after SENSE_CAP_SECONDS (the
# kernel's own buffer grows to megabytes, which a slow link then takes a second to carry, times the pairs
# that share it); at least a fast link's bandwidth-delay product (64 KB in flight, as Linux doubles it,
# fills 25 Gbit/s at a 20 us round trip).
SENSE_SEND_BUFFER = 32768

log = logging.getLogger("hvd_dssync")


def probe_rounds(leaders):
    """The probe's rounds of disjoint pairs of ``leaders``, every pair once (circle method).

    Example::

        >>> probe_rounds([0, 2, 4])
        [[(2, 4)], [(0, 4)], [(0, 2)]]
    """
    return [[(leaders[a], leaders[b]) for a, b in pairs] for pairs in round_robin_pairings(len(leaders))]


def pair_rounds(pairs):
    """Rounds of disjoint pairs holding each of ``pairs`` once, each pair in the first round where neither of
    its ends is busy (the order given decides, so every rank builds the same rounds).

    Example::

        >>> pair_rounds([(0, 1), (0, 2), (1, 3), (2, 3)])
        [[(0, 1), (2, 3)], [(0, 2), (1, 3)]]
    """
    rounds = []
    for a, b in pairs:
        free = next((r for r in rounds if all(a not in p and b not in p for p in r)), None)
        if free is None:
            rounds.append([])
            free = rounds[-1]
        free.append((a, b))
    return rounds


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

    Example::

        >>> import threading
        >>> server, client = PairProbe("127.0.0.1"), PairProbe("127.0.0.1")
        >>> serving = threading.Thread(target=server.server, args=(0, 65536, 2)); serving.start()
        >>> seconds = client.client(0, server.endpoint(), 65536, 2); serving.join()
        >>> 0 < seconds < 5
        True
        >>> server.close(); client.close()
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

    def client(self, rank, endpoint, nbytes, repeats, cap_seconds=SENSE_CAP_SECONDS,
               target_seconds=SENSE_TARGET_SECONDS):
        """Time the link to the partner at ``endpoint``: the fastest of ``repeats`` transfers, in seconds per
        ``nbytes`` (until the partner acknowledged the last byte).

        A first, unmeasured transfer of up to ``nbytes`` meets the partner and sizes the timed ones from its
        rate: each lasts about ``target_seconds`` (at least ``nbytes``, at most :data:`SENSE_MAX_NBYTES`); where
        it was cut short (a slow link), a third as many are timed (at least one). Any
        transfer stops sending once ``cap_seconds`` have passed (at least one chunk is sent): a slow link is
        timed on what it carried, so it costs about ``cap_seconds`` (plus what the socket still holds, at most
        :data:`SENSE_SEND_BUFFER` and its kernel's share) instead of ``nbytes`` at its own rate.
        """
        payload = memoryview(bytes(SENSE_MAX_CHUNK))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SENSE_SEND_BUFFER)
            conn.settimeout(self.timeout)
            conn.connect(tuple(endpoint))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(rank.to_bytes(4, "big"))
            seconds, sent = _transfer(conn, payload[:SENSE_CHUNK], nbytes, cap_seconds)
            rate = sent / max(seconds, 1e-9)
            size = int(min(SENSE_MAX_NBYTES, max(nbytes, rate * target_seconds)))
            chunk = int(min(SENSE_MAX_CHUNK, max(SENSE_CHUNK, rate * cap_seconds / 8)))
            # A link that could not carry nbytes within the cap is timed by the network, not by a busy core, and
            # each of its transfers costs what the socket holds to drain at its slow rate: a third as many.
            timed = repeats if sent >= nbytes else max(1, repeats // SENSE_REPEATS)
            fastest = math.inf
            for _ in range(timed):
                seconds, sent = _transfer(conn, payload[:chunk], size, cap_seconds)
                fastest = min(fastest, seconds * nbytes / sent)
        return fastest

    def server(self, partner, nbytes, repeats):
        """The other end of :meth:`client` for ``partner``: reads its transfers, acknowledging each, until the
        partner closes the connection."""
        conn = self._accept_from(partner)
        sink = memoryview(bytearray(SENSE_MAX_CHUNK))
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                header = _read_or_end(conn, 4)
                if header is None:
                    return
                n = int.from_bytes(header, "big")
                if n == 0:
                    conn.sendall(b"a")
                else:
                    _read_into(conn, sink[:n])


def _transfer(conn, payload, nbytes, cap_seconds):
    """Send up to ``nbytes`` in chunks of ``payload``'s size, stopping after ``cap_seconds``; ``(seconds until
    acknowledged, sent)``."""
    started = time.perf_counter()
    sent = 0
    while sent < nbytes and (sent == 0 or time.perf_counter() - started < cap_seconds):
        n = min(len(payload), nbytes - sent)
        conn.sendall(n.to_bytes(4, "big"))
        conn.sendall(payload[:n])
        sent += n
    conn.sendall((0).to_bytes(4, "big"))
    _read(conn, 1)
    return time.perf_counter() - started, sent


def _read_into(conn, view):
    got = 0
    while got < len(view):
        chunk = conn.recv_into(view[got:], len(view) - got)
        if not chunk:
            raise ConnectionError("the partner closed the connection")
        got += chunk


def _read_or_end(conn, n):
    """``n`` bytes, or ``None`` where the partner closed the connection before sending any."""
    view = bytearray(n)
    got = conn.recv_into(view, n)
    if got == 0:
        return None
    _read_into(conn, memoryview(view)[got:])
    return bytes(view)


def _read(conn, n):
    view = bytearray(n)
    _read_into(conn, memoryview(view))
    return bytes(view)


def measure(rank, leaders, endpoints, probe, nbytes=SENSE_NBYTES, repeats=SENSE_REPEATS, pairs=None):
    """This rank's figures: the fastest of ``repeats`` timed transfers to each host leader it is paired with
    (the pair's lower rank sends, the other acknowledges), in seconds per ``nbytes``, by host index; NaN
    elsewhere, and where a transfer failed (then every rank finds a figure missing).

    ``pairs``: the host-index pairs to time (every pair by default, in :func:`probe_rounds`; others in
    :func:`pair_rounds`). The pairs of a round run at the same time; a rank meets its next partner as soon
    as it is done with the last one (no barrier between rounds). ``endpoints`` are every rank's
    ``PairProbe.endpoint()``, ``probe`` this rank's :class:`PairProbe`.

    Example::

        >>> class Probe:
        ...     def client(self, rank, endpoint, nbytes, repeats): return 0.5 if endpoint == "e2" else 0.1
        ...     def server(self, partner, nbytes, repeats): pass
        >>> measure(0, [0, 1, 2], ["e0", "e1", "e2"], Probe()).tolist()
        [nan, 0.1, 0.5]
        >>> measure(0, [0, 1, 2], ["e0", "e1", "e2"], Probe(), pairs=[(0, 2)]).tolist()
        [nan, nan, 0.5]
    """
    index = {r: i for i, r in enumerate(leaders)}
    row = np.full(len(leaders), np.nan)
    rounds = probe_rounds(leaders) if pairs is None else \
        [[(leaders[a], leaders[b]) for a, b in r] for r in pair_rounds(pairs)]
    for round_pairs in rounds:
        for a, b in round_pairs:
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
