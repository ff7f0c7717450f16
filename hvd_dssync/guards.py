"""Run-time guards both adapters share: the members of a group are at the same step; no recycled NCCL sets.

Ranks that drift apart (one calls ``step()`` once more or once less than the others) would not hang when
the same group recurs at their different steps: they would silently average models of different steps,
forever after. Op names cannot carry the step (Horovod would negotiate a new name every step), so each
average carries the step's bits as 0 and 1 instead (:func:`step_signature`), in the model's own dtype where
that is exact, so they ride in the same fused collective; the members all receive the same sums and all
find out together (:func:`steps_differ`).

Framework-free: the adapters add the signature to the collective they already run.
"""
import numpy as np

__all__ = ["step_signature", "steps_differ", "describe_step_drift", "check_nccl_process_sets"]

_STEP_BITS = 32  # steps below 2**32


def step_signature(step):
    """The values one rank adds, for ``step``, to a collective that sums or averages: the step's bits, 0 or 1.

    0 and 1, their sums over a group and the sums' quotients by the group size are exact in float32 for any
    group of fewer than 2**24 ranks, so the signature can ride in the same dtype as a float32 model, in the
    same fused collective. The members' steps are equal exactly when every bit sums to 0 or to the group
    size (:func:`steps_differ`).

    Example::

        >>> step_signature(5).tolist()[:4]
        [1.0, 0.0, 1.0, 0.0]
    """
    step = int(step)
    if not 0 <= step < 2 ** _STEP_BITS:
        raise ValueError(f"step {step} is out of range for the step check")
    return np.array([(step >> k) & 1 for k in range(_STEP_BITS)], dtype=np.float64)


def steps_differ(sums, members):
    """Whether the ``members`` ranks that summed their :func:`step_signature` were at different steps.

    ``sums`` is the element-wise sum of the members' signatures (an average times ``members``); the same
    on every member, so every member takes the same decision. A bit that differs sums to between 1 and
    ``members - 1``, at least 1 away from both 0 and ``members``.

    Example::

        >>> steps_differ(step_signature(4) + step_signature(4), 2)
        False
        >>> steps_differ(step_signature(4) + step_signature(5), 2)
        True
        >>> steps_differ((step_signature(3) + step_signature(4) + step_signature(5)) / 3 * 3, 3)
        True
    """
    sums = np.asarray(sums, dtype=np.float64)
    return bool(np.any(np.minimum(np.abs(sums), np.abs(sums - members)) > 0.5))


def describe_step_drift(steps):
    """The error raised when the members of a group are at different steps; ``steps`` maps rank to step.

    Example::

        >>> describe_step_drift({0: 7, 1: 6})  # doctest: +ELLIPSIS
        'hvd_dssync: ranks of one group are at different DS-Sync steps: rank 0 at step 7, rank 1 at step 6; ...'
    """
    where = ", ".join(f"rank {r} at step {s}" for r, s in sorted(steps.items()))
    return (f"hvd_dssync: ranks of one group are at different DS-Sync steps: {where}; their models would be "
            "averaged with the wrong partners from now on. Every rank must call step() once per step (a "
            "skipped step must still call it), and a checkpoint loaded by one rank must reach the others "
            "before the first step (hvd.broadcast_optimizer_state right after load_state_dict).")


def check_nccl_process_sets(window_steps, nccl_built, on_gpu, gpu_operations=None):
    """Refuse a shuffle window that ends when Horovod would reduce GPU tensors with NCCL.

    Horovod caches one NCCL communicator per process-set id and never drops it, while it hands the id of a
    removed process set to the next one added; a finite window removes its sets and adds the next window's,
    which could then reduce with a communicator built for other ranks. ``window_steps`` is the schedule's
    (``None``: one endless window), ``nccl_built`` Horovod's ``nccl_built()``, ``on_gpu`` whether the
    averaged tensors are on a GPU, ``gpu_operations`` the ``HOROVOD_GPU_OPERATIONS`` (or
    ``HOROVOD_GPU_ALLREDUCE``) Horovod was built with, when known (``"MPI"`` does not use NCCL). Raises
    a ``ValueError`` before any communication; the decision is the same on every rank.

    Example::

        >>> check_nccl_process_sets(None, nccl_built=2708, on_gpu=True)      # endless window: fine
        >>> check_nccl_process_sets(200, nccl_built=0, on_gpu=False)         # Gloo or MPI on CPU: fine
        >>> check_nccl_process_sets(200, nccl_built=2708, on_gpu=True)       # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Arg ``schedule_options``: a schedule whose groups change every 200 steps ...
    """
    if window_steps is None or not nccl_built or not on_gpu:
        return
    if (gpu_operations or "NCCL").strip().upper() != "NCCL":
        return
    raise ValueError(
        f"Arg ``schedule_options``: a schedule whose groups change every {window_steps} steps (window_steps, or "
        "rotate_every for 'topology') cannot average GPU tensors with NCCL: Horovod keeps an NCCL communicator "
        "per process-set id and reuses the ids of removed sets, so a later window's groups could reduce with "
        "communicators built for other ranks. Use one endless window (the default: its process sets are never "
        "removed), or average CPU tensors (Gloo or MPI).")
