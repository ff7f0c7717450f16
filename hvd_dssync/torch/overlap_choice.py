"""The default's choice of overlap in the PyTorch adapter (``overlap=None``): the trial of :mod:`hvd_dssync.overlap`
timed on this rank's steps, its figures gathered once over the optimizer's ranks."""
import logging

import horovod.torch as hvd
import torch

from ..overlap import OverlapTrial

__all__ = ["OverlapChoice"]

log = logging.getLogger("hvd_dssync")


class OverlapChoice:
    """Which way each step averages while the trial runs, and the decision at its end.

    Args:
        name: the optimizer's op names.
        plan: the optimizer's :class:`hvd_dssync.plan.SyncPlan` (the warm-up, the averaging period, and the
            schedule's cycle of averages).
        choose_globals: the global averages may go through the racks or over every rank at once (the route is
            ``"auto"``): the trial's waited half decides which (:meth:`hvd_dssync.overlap.OverlapTrial.decide_globals`).

    Example::

        choice = OverlapChoice("dssync.0", plan, choose_globals=True)
        averaging.overlap = choice.overlap_at(step, sparse_in_use)
        averaging.global_fragments = choice.global_fragments_at(step)
        ...                                  # the step
        choice.end_step(world, step, local)  # an allgather at the waited half's end, the first look, the last step
    """

    def __init__(self, name, plan, choose_globals=False):
        self.name = name
        self.trial = OverlapTrial.of(plan, choose_globals)

    def overlap_at(self, step, sparse_in_use):
        """Whether ``step``'s average is overlapped; sparse averaging (agreed alike on every rank) rules it out."""
        if sparse_in_use and self.trial.decided is None:
            self.trial.rule_out()
        return self.trial.overlap_at(step)

    def global_fragments_at(self, step):
        """In how many fragments ``step``'s global average, if it has one, goes over every rank at once behind the
        steps (the trial's choice, where it kept them in flight); 0: through the racks, waited for."""
        return self.trial.fragments_at(step)

    def end_step(self, world, step, local):
        """Time the step (``local``: one with no average); where the trial is due, gather every rank's figures over
        the optimizer's process set and decide (:meth:`hvd_dssync.overlap.OverlapTrial.step_ended`). Returns the
        decision on overlap taken at this step, or None."""
        def gather(figures):
            return hvd.allgather(torch.from_numpy(figures), name=f"{self.name}.overlap",
                                 process_set=world.process_set).numpy()

        decided = self.trial.step_ended(step, gather, local)
        if decided is not None and world.scope.rank == 0:
            log.info(f"hvd_dssync: {self.trial.describe()}, from step {step + 1}")
        return decided
