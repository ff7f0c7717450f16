"""The bench's scenarios: what the network and the hosts do while every contender trains.

- ``static``: the racks behind a slow link (``--inter-mbit``);
- ``dynamic``: the link between racks starts at the intra-rack rate and drops to ``--inter-mbit``
  ``--dynamic-after`` seconds into each contender's training (contention appears);
- ``recover``: the same drop, then back to the intra-rack rate ``--recover-after`` seconds into training
  (contention comes and goes: the network changes twice);
- ``bandwidth``: a model of several million parameters (``--bandwidth-hidden``) on links ten times
  faster (``--bandwidth-intra-mbit``, ``--bandwidth-inter-mbit``), so that the time a collective spends on
  the slow link, not its fixed per-collective cost, dominates a step;
- ``stragglers``: no slow link; instead one host at a time computes slowly for a few seconds, on a
  timetable drawn from the seed (:func:`straggler_at`), the same for every contender;
- ``transient``: no slow link; the last host computes slowly once, from ``--transient-from`` for
  ``--transient-seconds`` seconds (a transient straggler);
- ``none``: no bottleneck, the link between racks as fast as the hosts' own links;
- ``accelerator``: a GPU cluster's ratio of communication to compute, emulated: the bandwidth scenario's
  24 MB model on its links (4000 Mbit/s hosts, 400 Mbit/s between racks), and every training step waits
  ``--accelerator-compute-ms`` (100 ms) more, standing for a GPU's forward and backward pass while the
  rank's CPU stays free (the method of compute-emulating testbeds, NeuronaBox arXiv 2405.02969). A ResNet-50
  step on a V100 at batch 64 takes 100-200 ms, a ring allreduce of its 100 MB over 10 Gbit/s about 0.16 s:
  inside a rack communication is of the order of compute (here 24 MB over 4000 Mbit/s per 100 ms), between
  racks behind an uplink oversubscribed about 10:1 several times it (here about 0.8 s).

Every scenario also takes ``--compute-ms`` (0 by default): each step waits that much more, on every rank
and for every contender alike.

A scenario is a plain dict: ``name``, ``intra_mbit``, ``inter_mbit``, ``rate_changes`` (``[[seconds, mbit],
...]``: the inter-rack rate from that many seconds into training), ``hidden`` (the MLP width) and
``stragglers`` (``None``, a timetable drawn from the seed ``{"period", "slow", "delay"}``, or fixed slow
phases ``{"phases": [[start, end, rank], ...], "delay"}``).
"""
import numpy as np

__all__ = ["SCENARIOS", "scenario", "slow_rank", "straggler_at", "straggler_timetable"]

SCENARIOS = ("static", "dynamic", "recover", "bandwidth", "stragglers", "transient", "none", "accelerator")


def scenario(name, args):
    """The scenario ``name`` built from the bench's parsed arguments.

    Example::

        >>> from hvd_dssync.bench.cli import build_parser
        >>> scenario("stragglers", build_parser().parse_args([]))["stragglers"]
        {'period': 6.0, 'slow': 3.0, 'delay': 0.25}
    """
    out = {"name": name, "intra_mbit": args.intra_mbit, "inter_mbit": args.intra_mbit, "rate_changes": [],
           "hidden": args.hidden, "stragglers": None, "compute_ms": args.compute_ms}
    if name == "static":
        out["inter_mbit"] = args.inter_mbit
    elif name == "dynamic":
        out["rate_changes"] = [[args.dynamic_after, args.inter_mbit]]
    elif name == "recover":
        if args.recover_after <= args.dynamic_after:
            raise ValueError(f"--recover-after ({args.recover_after}) must come after --dynamic-after "
                             f"({args.dynamic_after})")
        out["rate_changes"] = [[args.dynamic_after, args.inter_mbit], [args.recover_after, args.intra_mbit]]
    elif name == "bandwidth":
        out.update(intra_mbit=args.bandwidth_intra_mbit, inter_mbit=args.bandwidth_inter_mbit,
                   hidden=args.bandwidth_hidden)
    elif name == "stragglers":
        out["stragglers"] = {"period": args.straggler_period, "slow": args.straggler_slow,
                             "delay": args.straggler_delay}
    elif name == "transient":
        start = args.transient_from
        out["stragglers"] = {"phases": [[start, start + args.transient_seconds, args.ranks - 1]],
                             "delay": args.straggler_delay}
    elif name == "accelerator":
        out.update(intra_mbit=args.bandwidth_intra_mbit, inter_mbit=args.bandwidth_inter_mbit,
                   hidden=args.bandwidth_hidden, compute_ms=args.compute_ms + args.accelerator_compute_ms)
    elif name != "none":
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")
    return out


def slow_rank(stragglers, seconds, seed, world_size):
    """The rank that scenario ``stragglers`` slows ``seconds`` into training, or ``None``.

    Example::

        >>> slow_rank({"phases": [[4.0, 12.0, 7]], "delay": 0.25}, 5.0, seed=0, world_size=8)
        7
        >>> slow_rank({"period": 6.0, "slow": 3.0, "delay": 0.25}, 1.0, seed=0, world_size=8)
        6
    """
    if not stragglers:
        return None
    if "phases" in stragglers:
        return next((rank for start, end, rank in stragglers["phases"] if start <= seconds < end), None)
    return straggler_at(seconds, seed, world_size, stragglers["period"], stragglers["slow"])


def straggler_at(seconds, seed, world_size, period, slow):
    """The rank that is slow ``seconds`` into training, or ``None``; the same answer on every rank.

    Time is cut into windows of ``period`` seconds; in each, one rank drawn from ``(seed, window)`` is
    slow for ``slow`` seconds starting at a drawn offset. No state and no communication: every rank and
    every contender evaluates the same timetable.

    Example::

        >>> [straggler_at(t, seed=0, world_size=8, period=6.0, slow=3.0) for t in (0.0, 1.0, 2.0, 5.0)]
        [None, 6, 6, None]
    """
    if seconds < 0 or not 0 < slow <= period:
        return None
    start, end, rank = _slow_phase(seed, world_size, period, slow, int(seconds // period))
    return rank if start <= seconds < end else None


def straggler_timetable(seed, world_size, period, slow, until):
    """``[(start, end, rank)]``: the slow phases of :func:`straggler_at` up to ``until`` seconds.

    Example::

        >>> [(round(a, 2), round(b, 2), r) for a, b, r in straggler_timetable(0, 8, 6.0, 3.0, 12.0)]
        [(0.81, 3.81, 6), (7.67, 10.67, 4)]
    """
    return [_slow_phase(seed, world_size, period, slow, window) for window in range(int(np.ceil(until / period)))]


def _slow_phase(seed, world_size, period, slow, window):
    rng = np.random.default_rng([seed, window])
    rank = int(rng.integers(world_size))
    start = window * period + float(rng.uniform(0.0, period - slow))
    return start, start + slow, rank
