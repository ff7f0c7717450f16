"""The rack rule: which hosts form racks, read from the seconds of a timed transfer between every pair.

A two-tier network (hosts on a rack's switch, racks joined by slower uplinks) gives two populations of
pair times: fast inside a rack, slow across racks. The rule looks for that structure as a whole, never
against one pair: every cut between two neighbouring pair times splits the links into fast and slow; the
hosts joined by fast links form candidate racks; a candidate counts where every pair inside a rack is
faster than every pair across racks, and its **margin** is the slowest pair inside over the fastest pair
across, turned around (``fastest across / slowest inside``). The candidate of the widest margin wins if the
margin is at least :data:`MIN_MARGIN`; otherwise the network is one flat network (the safe choice: every
schedule works on it), and the pairs in the widest candidate's band are the ones worth timing again; where
it is far from racks (a margin under ``1 / MIN_MARGIN``), only a few links inside that slow (at most one for
every two hosts: stalls) are timed again, with the links across left in doubt by its others; more, and
it is one flat network.

What is never a rack:

- a host linked fast to some members of a rack and slow to others: a contradiction, not a rack (the
  candidate's margin is then below 1);
- a rack of one host: a host whose every link is slow may sit alone behind a slow link or be a slow host
  (a busy core, a slower NIC), and the figures cannot tell which; nor can they tell racks of one host each
  from a flat network where one pair happened to be timed fast. Hosts that each run several ranks still
  become a rack each where the rule finds one flat network (:func:`hvd_dssync.sensing.job.sense`).

Numpy only, no communication: every rank derives the same answer from the same gathered figures.
"""
import math

import numpy as np

__all__ = ["MIN_MARGIN", "RackDecision", "pair_seconds", "seconds_of_pairs", "decide_racks", "rank_racks"]

# The fastest link across racks must be this many times slower than the slowest link inside one. Measured on
# the bench's emulated networks (docs/tuning.md): on networks with a 10x slower link between the racks the
# margin found was 2.7x and more; on flat networks the widest candidate's margin stayed under 1.6x.
MIN_MARGIN = 2.0


class RackDecision:
    """What :func:`decide_racks` found: ``racks`` (lists of host indices; one list for a flat network),
    ``margin`` (the widest candidate's, ``nan`` where there was none), whether it is ``sure`` (a margin of at
    least ``min_margin``, no candidate at all, or one far from racks by many links) and the ``ambiguous``
    host pairs worth timing again.

    Example::

        >>> d = RackDecision([[0, 1], [2, 3]], 3.0, sure=True)
        >>> d.flat, d.describe()
        (False, 'margin 3.0x')
    """

    def __init__(self, racks, margin, sure, ambiguous=()):
        self.racks = [list(r) for r in racks]
        self.margin = float(margin)
        self.sure = bool(sure)
        self.ambiguous = [tuple(p) for p in ambiguous]

    @property
    def flat(self):
        return len(self.racks) < 2

    def describe(self, min_margin=MIN_MARGIN):
        if not self.flat:
            return f"margin {self.margin:.1f}x"
        if math.isnan(self.margin):
            return "no rack structure"
        return f"no clear margin (widest {self.margin:.1f}x, {min_margin:g}x needed)"

    def __repr__(self):
        return f"RackDecision(racks={self.racks}, margin={self.margin:.2f}, sure={self.sure})"


def pair_seconds(gathered, leaders):
    """The symmetric matrix of seconds between the hosts of ``leaders`` (their first ranks) from every rank's
    figures (``gathered[rank][host index]``, NaN where that rank timed nothing): a pair's seconds are the
    larger of its two ends' figures, ``inf`` where neither end has one; the diagonal is 0.

    Example::

        >>> nan = float("nan")
        >>> pair_seconds([[nan, .01], [.02, nan]], [0, 1]).tolist()
        [[0.0, 0.02], [0.02, 0.0]]
    """
    gathered = np.asarray(gathered, dtype=float)
    n = len(leaders)
    seconds = np.zeros((n, n))
    for a in range(n):
        for b in range(a + 1, n):
            ends = [s for s in (gathered[leaders[a], b], gathered[leaders[b], a]) if not math.isnan(s)]
            seconds[a, b] = seconds[b, a] = max(ends) if ends else math.inf
    return seconds


def seconds_of_pairs(by_pair):
    """``(leaders, seconds)`` from figures by pair as ``opt.sensed["seconds_by_pair"]`` holds them
    (``{"a-b": seconds}``, ``a`` and ``b`` the hosts' first ranks): the ranks in order and the symmetric matrix
    of :func:`decide_racks` (``inf`` for a pair not given).

    Example::

        >>> leaders, seconds = seconds_of_pairs({"0-2": 0.01, "0-4": 0.1, "2-4": 0.1})
        >>> leaders, seconds[0].tolist()
        ([0, 2, 4], [0.0, 0.01, 0.1])
    """
    pairs = {tuple(sorted(int(r) for r in key.split("-"))): float(value) for key, value in by_pair.items()}
    leaders = sorted({r for pair in pairs for r in pair})
    index = {r: i for i, r in enumerate(leaders)}
    seconds = np.full((len(leaders), len(leaders)), math.inf)
    np.fill_diagonal(seconds, 0.0)
    for (a, b), value in pairs.items():
        seconds[index[a], index[b]] = seconds[index[b], index[a]] = value
    return leaders, seconds


def _candidates(seconds):
    """The partitions single linkage makes as the cut rises between distinct pair times (Kruskal's order),
    from the first merge to the last with two racks or more: the hosts' rack labels, each partition once."""
    n = len(seconds)
    rows, cols = np.triu_indices(n, 1)
    order = np.argsort(seconds[rows, cols], kind="stable")
    times = seconds[rows, cols][order]
    label = np.arange(n)
    merged = False
    for k, edge in enumerate(order):
        a, b = label[rows[edge]], label[cols[edge]]
        if a != b:
            label[label == b] = a
            merged = True
        last_of_its_time = k + 1 == len(order) or times[k + 1] > times[k]
        if merged and last_of_its_time:
            if (label == label[0]).all():
                return
            merged = False
            yield label.copy()


def _margin(seconds, label):
    """``(fastest across, slowest inside)`` of the partition of the hosts by rack ``label``."""
    rows, cols = np.triu_indices(len(seconds), 1)
    inside = label[rows] == label[cols]
    values = seconds[rows, cols]
    return values[~inside].min(), values[inside].max(initial=0.0)


def _allowed(label):
    _, counts = np.unique(label, return_counts=True)
    return len(counts) >= 2 and (counts > 1).all()


def decide_racks(seconds, min_margin=MIN_MARGIN):
    """The racks of hosts from the symmetric matrix ``seconds`` (see the module's docstring): a
    :class:`RackDecision`. ``inf`` marks a pair nobody timed (the caller decides what that means; here it
    is slow).

    Example::

        >>> s = np.array([[0, 1, 9, 9], [1, 0, 9, 8], [9, 9, 0, 2], [9, 8, 2, 0]], dtype=float)
        >>> decide_racks(s).racks, decide_racks(s).margin
        ([[0, 1], [2, 3]], 4.0)
        >>> decide_racks(np.array([[0, 1, 1.5], [1, 0, 1.2], [1.5, 1.2, 0]])).racks  # flat
        [[0, 1, 2]]
    """
    seconds = np.asarray(seconds, dtype=float)
    n = len(seconds)
    best, best_margin, best_pair = None, -math.inf, None
    for label in _candidates(seconds):
        if not _allowed(label):
            continue
        across, inside = _margin(seconds, label)
        margin = across / inside if inside > 0 else math.inf
        if margin > best_margin:
            best, best_margin, best_pair = label, margin, (inside, across)
    flat = [list(range(n))]
    if best is None:
        return RackDecision(flat, math.nan, sure=True)
    if best_margin >= min_margin:
        racks = sorted([int(h) for h in np.flatnonzero(best == k)] for k in np.unique(best))
        return RackDecision(racks, best_margin, sure=True)
    inside, across = best_pair
    if best_margin < 1 / min_margin:
        # Far from racks: links inside more than min_margin times slower than the fastest across. A few such
        # links (at most one for every two hosts) may be stalls, timed again with the links across that their
        # racks' other links leave in doubt; more are no racks.
        rows, cols = np.triu_indices(n, 1)
        same = best[rows] == best[cols]
        slow = same & (seconds[rows, cols] * min_margin > across)
        if slow.sum() > n // 2:
            return RackDecision(flat, best_margin, sure=True)
        rest = seconds[rows, cols][same & ~slow].max(initial=0.0)
        doubt = slow | (~same & (seconds[rows, cols] < rest * min_margin))
        return RackDecision(flat, best_margin, sure=False,
                            ambiguous=[(int(i), int(j)) for i, j in zip(rows[doubt], cols[doubt])])
    # Unsure: the pairs in the band that a margin of min_margin would have to leave empty, centred
    # (geometrically) between the widest candidate's slowest pair inside and its fastest across.
    centre = math.sqrt(inside * across) if math.isfinite(across) else inside
    low, high = centre / math.sqrt(min_margin), centre * math.sqrt(min_margin)
    ambiguous = [(i, j) for i in range(n) for j in range(i + 1, n) if low <= seconds[i, j] <= high]
    return RackDecision(flat, best_margin, sure=False, ambiguous=ambiguous)


def rank_racks(host_racks, leaders, rank_hosts):
    """Racks of ranks from racks of host indices (``leaders[h]`` is host ``h``'s first rank): every rank of a
    host goes where its host goes. Sorted.

    Example::

        >>> rank_racks([[0, 1], [2]], [0, 2, 3], ["a", "a", "b", "c"])
        [[0, 1, 2], [3]]
    """
    host_of_leader = [rank_hosts[r] for r in leaders]
    rack_of_host = {host_of_leader[h]: k for k, rack in enumerate(host_racks) for h in rack}
    racks = {}
    for rank, host in enumerate(rank_hosts):
        racks.setdefault(rack_of_host[host], []).append(rank)
    return sorted(racks.values())
