"""How fast a schedule mixes: the consensus error of pure group averaging, the mixing matrix, the spectral gap.

The theory is in :mod:`hvd_dssync.simulate`'s text; everything here is numpy on N-row arrays.
"""
import math

import numpy as np

from ..schedules import _check_int
from .partitions import _check_positive, _group_average, _partitions

__all__ = ["DENSE_LIMIT", "consensus_error", "steps_to_error", "mixing_matrix", "spectral_gap"]

DENSE_LIMIT = 512


def _rms(x):
    return math.sqrt(float(np.vdot(x, x)) / x.shape[0])


def consensus_error(schedule, steps, dim=8, seed=0, start=0):
    """Relative consensus error after each of ``steps`` steps of pure group averaging.

    Each worker starts from a random vector of length ``dim`` (seeded by ``seed``); step ``t`` replaces
    every vector by the mean of its group in ``schedule.groups(t)``. The error is the root mean square
    distance of the workers' vectors from their global mean, divided by the initial one: 1 at the
    start, 0 at exact consensus, never increasing.

    Args:
        schedule: any :class:`hvd_dssync.schedules.Schedule`.
        steps: how many steps to simulate.
        dim: length of each worker's vector (more averages out the luck of the draw).
        seed: seed of the initial vectors.
        start: first step simulated.

    Returns:
        A float array of length ``steps``; entry ``i`` is the error after step ``start + i``.

    Example::

        >>> from hvd_dssync.schedules import Butterfly
        >>> [round(float(e), 6) for e in consensus_error(Butterfly(8), 3)][-1]
        0.0
    """
    steps = _check_int("steps", steps, 0)
    dim = _check_int("dim", dim, 1)
    seed = _check_int("seed", seed, 0)
    start = _check_int("start", start, 0)
    errors = np.zeros(steps)
    if schedule.world_size == 1:
        return errors
    x = np.random.default_rng(seed).standard_normal((schedule.world_size, dim))
    # Averaging keeps the global mean, so centring once makes the error the plain RMS of x.
    x -= x.mean(axis=0)
    initial = _rms(x)
    for i, (_, part) in enumerate(_partitions(schedule, start, start + steps)):
        x = _group_average(x, part)
        errors[i] = _rms(x) / initial
    return errors


def steps_to_error(errors, target=1e-3):
    """The number of steps after which ``errors`` (from :func:`consensus_error`) first reach ``target``.

    ``None`` when they never do within the simulated steps.

    Example::

        >>> steps_to_error([0.5, 0.01, 1e-4], target=1e-3)
        3
    """
    target = _check_positive("target", target)
    reached = np.flatnonzero(np.asarray(errors) <= target)
    return int(reached[0]) + 1 if reached.size else None


def _default_period(schedule, start):
    return len(schedule.partitions(schedule.window_of(start)))


def mixing_matrix(schedule, start=0, period=None):
    """The N x N product ``W = A_{start+p-1} ... A_{start}`` of ``p = period`` averaging steps.

    ``period`` defaults to the length of the cycle of partitions that ``start``'s window uses (for
    example 2 for the default Shuffle, ``steps_to_consensus`` for Butterfly, ``intra_steps + 1`` for
    TopologyAware). ``W[i, j]`` is the weight of worker ``j``'s initial value in worker ``i``'s final
    one. Dense: for tests and small N.

    Example::

        >>> from hvd_dssync.schedules import Butterfly
        >>> bool(np.allclose(mixing_matrix(Butterfly(4)), 0.25))
        True
    """
    start = _check_int("start", start, 0)
    period = _default_period(schedule, start) if period is None else _check_int("period", period, 1)
    w = np.eye(schedule.world_size)
    for _, part in _partitions(schedule, start, start + period):
        w = _group_average(w, part)
    return w


def _sigma_dense(schedule, start, period):
    w = mixing_matrix(schedule, start, period)
    return float(np.linalg.norm(w - 1.0 / schedule.world_size, 2))


def _sigma_iterative(schedule, start, period, block, tol, max_iter):
    """sigma = ||W - J||_2 by block power iteration on ``(W - J)^T (W - J) = W^T W - J``.

    ``W`` is applied as its ``period`` group averagings and ``W^T`` as the same averagings in reverse
    order (each ``A_t`` is symmetric); the mean is projected out, which deflates the eigenvalue 1 of
    the consensus direction. A Rayleigh-Ritz step on the block estimates the top eigenvalue
    ``sigma^2``; iteration stops when it changes by less than ``tol`` (it rises monotonically to the
    true value, faster than the vectors converge).
    """
    parts = [part for _, part in _partitions(schedule, start, start + period)]
    n = schedule.world_size
    q = np.random.default_rng(0).standard_normal((n, min(block, n - 1)))
    q -= q.mean(axis=0)
    q, _ = np.linalg.qr(q)
    previous = -1.0
    for _ in range(max_iter):
        z = q
        for part in parts:
            z = _group_average(z, part)
        for part in reversed(parts):
            z = _group_average(z, part)
        z -= z.mean(axis=0)
        ritz = q.T @ z
        sigma2 = float(np.linalg.eigvalsh((ritz + ritz.T) / 2)[-1])
        if abs(sigma2 - previous) <= tol:
            break
        previous = sigma2
        q, _ = np.linalg.qr(z)
    return math.sqrt(max(sigma2, 0.0))


def spectral_gap(schedule, start=0, period=None, method="auto", tol=1e-12, max_iter=5000, block=8):
    """``1 - sigma_2(W)`` for the product ``W`` of one period of the schedule (see :mod:`hvd_dssync.simulate`).

    The gap is the fraction of the distance from consensus that one period removes at least: 1 when a
    period gives the exact global average (Butterfly), 0 when it leaves some workers unconnected.

    Args:
        schedule: any :class:`hvd_dssync.schedules.Schedule`.
        start, period: the steps ``start .. start + period - 1`` (see :func:`mixing_matrix`).
        method: "dense" forms ``W`` and takes its SVD; "iterative" never forms it and runs block power
            iteration on ``W^T W - J`` applied through group means (O(N) memory per vector); "auto" is
            dense up to ``DENSE_LIMIT`` workers.
        tol, max_iter, block: the iterative method's stop on the change of ``sigma^2``, its iteration
            cap, and its block size.

    Example::

        >>> from hvd_dssync.schedules import Butterfly
        >>> round(spectral_gap(Butterfly(16)), 9)
        1.0
    """
    start = _check_int("start", start, 0)
    period = _default_period(schedule, start) if period is None else _check_int("period", period, 1)
    if method not in ("auto", "dense", "iterative"):
        raise ValueError(f"Arg ``method`` must be 'auto', 'dense' or 'iterative', got {method!r}.")
    if schedule.world_size == 1:
        return 1.0
    if method == "dense" or (method == "auto" and schedule.world_size <= DENSE_LIMIT):
        sigma = _sigma_dense(schedule, start, period)
    else:
        sigma = _sigma_iterative(schedule, start, period, _check_int("block", block, 1),
                                 _check_positive("tol", tol), _check_int("max_iter", max_iter, 1))
    return 1.0 - sigma
