"""The adaptive policy's part of a step (:mod:`hvd_dssync.adaptive`) for the PyTorch adapter.

The ranks measure what their averages cost and how far apart their models drift; the figures ride along
in the step's average where they can, else one small collective gathers them; every rank then takes the
same decision from the same figures.
"""
import functools
import math
import time

import horovod.torch as hvd
import torch

from ..adaptive import decode_figures, drift_of, encode_figures
from ..plan import GLOBAL, GROUP, Action
from . import collectives

__all__ = ["AdaptiveStep"]


class AdaptiveStep:
    """The figures of an optimizer's steps, and the adaptive policy's decisions from them.

    Each call gets the :class:`hvd_dssync.world.World` it runs in (the policy is its plan's
    ``adaptive``) and the step; waits are bounded by ``guard`` (:class:`.step_guard.StepGuard`).

    Example::

        adaptive = AdaptiveStep("dssync.0", guard)
        early = adaptive.check_early(world, step)           # before the step's action is read
        ...                                                  # the local update and the average (average())
        decision = adaptive.end_step(world, step, action, done, early)
    """

    def __init__(self, name, guard):
        self.name = name  # the optimizer's op names
        self.guard = guard
        self.drift = float("nan")
        self._gathered = None  # every rank's figures, when they rode along an average
        self._step_ended = None  # when the last step() returned, for the compute time

    def average(self, world, step, tensors, signature, name, process_set, action):
        """The average, with what the adaptive policy needs riding along in the same collective: in a group
        average, each member's squared norm (one element), so that the members learn how far apart their
        models were (:func:`drift_of`; the policy uses it under group averaging only, so global averages
        skip the norms); at a decision step under global averaging, every rank's figures
        (:func:`encode_figures`), and at a global average inside a window, the last period's ones (unless the
        ranks exchanged them before it: :meth:`check_early`). Returns the averaged signature."""
        adaptive, size = world.plan.adaptive, world.scope.world_size
        measuring, figures = action.kind == GROUP, adaptive.carried_figures(step)
        extra = [_square_norm(tensors)] if measuring else []
        if figures is not None:
            extra += encode_figures(figures, world.scope.rank, size).tolist()
        if not extra:
            collectives.grouped_allreduce_(tensors + [signature], name=name, op=hvd.Average, process_set=process_set)
            return signature
        carried = torch.cat([signature, torch.tensor(extra, dtype=signature.dtype)])
        collectives.grouped_allreduce_(tensors + [carried], name=name, op=hvd.Average, process_set=process_set)
        at = len(signature)
        if measuring:
            self.drift = drift_of(float(carried[at]), _square_norm(tensors))
        if figures is not None:
            self._gathered = decode_figures(carried[at + measuring:].double().numpy(), size, averaged=True)
        return carried[:at]

    def end_step(self, world, step, action, done, early=None):
        """Note this step's figures; at a decision step, decide from every rank's figures (which rode along
        in the step's global average, or else one small allgather after it: a probe, whose average's time
        they count, or the first window's end). ``done``: what the step's synchronization did
        (:class:`hvd_dssync.world.Done`, or None); ``early``: the decision this step's early check took.
        Returns the decision taken at this step, or None."""
        now = time.perf_counter()
        seconds = done.seconds if done is not None and done.action.kind == action.kind else math.nan
        compute = math.nan if self._step_ended is None else now - self._step_ended - (seconds if seconds > 0 else 0.0)
        gathered, self._gathered = self._gathered, None
        decision = world.plan.adaptive.end_step(step, action.kind, seconds, compute, self.drift, gathered=gathered,
                                                gather=functools.partial(self._gather_figures, world, step, action))
        self._step_ended = time.perf_counter()
        return decision or early

    def check_early(self, world, step):
        """With ``switch_early="exchange"``, before a global average inside a window (an early check):
        exchange the last period's figures (one small allreduce, bounded by the watchdog) and let the
        adaptive policy make this very step a group average (``check_early``); returns its decision, or
        ``None``. Every rank reads the same sum."""
        adaptive, size = world.plan.adaptive, world.scope.world_size
        figures = adaptive.early_figures(step)
        if figures is None:
            return None
        with self.guard.bounded(world, Action(GLOBAL, tuple(range(size))), step):
            summed = torch.from_numpy(encode_figures(figures, world.scope.rank, size))
            collectives.allreduce_(summed, name=f"{self.name}.adaptive.early", op=hvd.Sum,
                                   process_set=world.process_set)
        return adaptive.check_early(step, decode_figures(summed.numpy(), size))

    def _gather_figures(self, world, step, action, figures):
        """Every rank's adaptive figures, gathered after the step's average (a probe's, or one that could not
        carry them: compression, overlap, a world of one), bounded by the watchdog."""
        everyone = action._replace(kind=GLOBAL, group=tuple(range(world.scope.world_size)))
        with self.guard.bounded(world, everyone, step):
            return collectives.allgather(torch.from_numpy(figures), name=f"{self.name}.adaptive",
                                         process_set=world.process_set).numpy()


def _square_norm(tensors):
    """The squared norm of all ``tensors`` together, accumulated in float64 without a float64 copy of them."""
    return sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors)
