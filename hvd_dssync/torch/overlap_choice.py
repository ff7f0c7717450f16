"""The default's choice of overlap in the PyTorch adapter (``overlap=None``): the trial of :mod:`hvd_dssync.overlap`
timed on this rank's steps, its figures gathered once over the optimizer's ranks."""
import logging
import time

import horovod.torch as hvd
import torch

from ..fragments import fragment_ranges
from ..overlap import OverlapTrial
from . import collectives

__all__ = ["OverlapChoice", "probe_ring", "warm_fragment"]

log = logging.getLogger("hvd_dssync")


class OverlapChoice:
    """Which way each step averages while the trial runs, and the decision at its end.

    Args:
        name: the optimizer's op names.
        plan: the optimizer's :class:`hvd_dssync.plan.SyncPlan` (the warm-up, the averaging period, and the
            schedule's cycle of averages).
        choose_globals: the global averages may go through the racks or over every rank at once (the route is
            ``"auto"``): the trial decides which from a probe before its waited half (:func:`probe_ring`,
            :meth:`hvd_dssync.overlap.OverlapTrial.decide_globals`).
        quickens: the racks' period is the default's: the trial starts at half of it, keeps it where their averages
            hide, else goes back (``trial.average_every``: :mod:`hvd_dssync.rhythm`), which the optimizer's plan
            follows.

    Example::

        choice = OverlapChoice("dssync.0", plan, choose_globals=True)
        averaging.overlap = choice.overlap_at(step, sparse_in_use)
        averaging.global_fragments = choice.global_fragments_at(step)
        done = averaging.average_model(world, action, step)   # the step
        choice.end_step(world, step, local, tensors, done)  # an allgather after the set-up, at the look, at the end
    """

    def __init__(self, name, plan, choose_globals=False, quickens=False):
        self.name = name
        self.trial = OverlapTrial.of(plan, choose_globals, quickens=quickens)

    def overlap_at(self, step, sparse_in_use):
        """Whether ``step``'s average is overlapped; sparse averaging (agreed alike on every rank) rules it out."""
        if sparse_in_use and self.trial.decided is None:
            self.trial.rule_out()
        return self.trial.overlap_at(step)

    def global_fragments_at(self, step):
        """In how many fragments ``step``'s global average, if it has one, goes over every rank at once behind the
        steps (the trial's choice, where it kept them in flight); 0: through the racks, waited for."""
        return self.trial.fragments_at(step)

    def end_step(self, world, step, local, tensors, done=None):
        """Time the step (``local``: one with no average; ``done``: what its average did, a fold of an average in
        flight among it: :meth:`hvd_dssync.overlap.OverlapTrial.note_fold`); where the trial is due, gather every
        rank's figures over the optimizer's process set and decide (:meth:`hvd_dssync.overlap.OverlapTrial.step_ended`),
        after the set-up period from a probe of the global averages' way (:func:`probe_ring`; ``tensors()``: the
        tensors an average sends); where it warms the fragments, warm them (:func:`warm_fragment`). Returns
        the decision on overlap taken at this step, or None."""
        def gather(figures):
            return hvd.allgather(torch.from_numpy(figures), name=f"{self.name}.overlap",
                                 process_set=world.process_set).numpy()

        def warm(fragments):
            warm_fragment(world, f"{self.name}.warm", tensors(), fragments)

        def probe(fragments):
            return probe_ring(world, f"{self.name}.probe", tensors(), fragments)

        decided = self.trial.step_ended(step, gather, local, warm, None if done is None else done.folded, probe)
        if decided is not None and world.scope.rank == 0:
            log.info(f"hvd_dssync: {self.trial.describe()}, from step {step + 1}")
        return decided


def probe_ring(world, name, tensors, fragments):
    """The seconds of one ring over the optimizer's ranks of the first of ``fragments`` fragments of the model
    (``tensors``), of zeros, on every rank at the same step: after an untimed one (a set's first op of a size costs
    more than the next) and a tiny op that every rank leaves together (a rank that entered later would time less)."""
    warm_fragment(world, f"{name}.warm", tensors, fragments)
    collectives.allreduce_(torch.zeros(1), name=f"{name}.together", op=hvd.Sum, process_set=world.process_set)
    started = time.perf_counter()
    warm_fragment(world, f"{name}.ring", tensors, fragments)
    return time.perf_counter() - started


def warm_fragment(world, name, tensors, fragments):
    """One op of zeros of the first of ``fragments`` fragments of the model (``tensors``) over the optimizer's ranks,
    every rank at the same step (:meth:`hvd_dssync.overlap.OverlapTrial.warms`)."""
    sizes, dtype = [t.numel() for t in tensors], tensors[0].dtype
    first = sum(b - a for _, a, b in fragment_ranges(sizes, fragments)[0])
    collectives.allreduce_(torch.zeros(first, dtype=dtype), name=f"{name}.fragment", op=hvd.Sum,
                           process_set=world.process_set)
