"""The default's choice of overlap in the PyTorch adapter (``overlap=None``): the trial of :mod:`hvd_dssync.overlap`
timed on this rank's steps, its figures gathered once over the optimizer's ranks."""
import logging

import horovod.torch as hvd
import torch

from ..fragments import fragment_ranges
from ..overlap import OverlapTrial
from . import collectives

__all__ = ["OverlapChoice", "warm_way"]

log = logging.getLogger("hvd_dssync")


class OverlapChoice:
    """Which way each step averages while the trial runs, and the decision at its end.

    Args:
        name: the optimizer's op names.
        plan: the optimizer's :class:`hvd_dssync.plan.SyncPlan` (the warm-up, the averaging period, and the
            schedule's cycle of averages).
        choose_globals: the global averages may go through the racks or over every rank at once (the route is
            ``"auto"``): the trial's waited half decides which (:meth:`hvd_dssync.overlap.OverlapTrial.decide_globals`).
        registry: the schedule's process sets (the route's sets, warmed before each half's first global average
            is timed: :func:`warm_way`).

    Example::

        choice = OverlapChoice("dssync.0", plan, choose_globals=True, registry=registry)
        averaging.overlap = choice.overlap_at(step, sparse_in_use)
        averaging.global_fragments = choice.global_fragments_at(step)
        done = averaging.average_model(world, action, step)   # the step
        choice.end_step(world, step, local, tensors, done)  # an allgather at the waited half's end, the look, the end
    """

    def __init__(self, name, plan, choose_globals=False, registry=None):
        self.name = name
        self.trial = OverlapTrial.of(plan, choose_globals)
        self.registry = registry

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
        rank's figures over the optimizer's process set and decide (:meth:`hvd_dssync.overlap.OverlapTrial.step_ended`);
        where it warms a way of the global averages, warm it (:func:`warm_way`; ``tensors()``: the tensors an average
        sends). Returns the decision on overlap taken at this step, or None."""
        def gather(figures):
            return hvd.allgather(torch.from_numpy(figures), name=f"{self.name}.overlap",
                                 process_set=world.process_set).numpy()

        def warm(fragments):
            warm_way(world, f"{self.name}.warm", step, tensors(), self.registry, fragments)

        decided = self.trial.step_ended(step, gather, local, warm, None if done is None else done.folded)
        if decided is not None and world.scope.rank == 0:
            log.info(f"hvd_dssync: {self.trial.describe()}, from step {step + 1}")
        return decided


def warm_way(world, name, step, tensors, registry, fragments):
    """One op of zeros on the sets a way of the global averages sends across the racks, of the size it sends there,
    every rank of the optimizer at the same step (:meth:`hvd_dssync.overlap.OverlapTrial.warms`). ``fragments``: 0,
    the route's op across the racks after ``step`` (a speaker's of the model's size of ``tensors``, every other
    rank's a tiny one in its group of the bridge step, as the route's: every rank issues as many ops), then a tiny
    one over the optimizer's ranks; else one fragment of a global average in that many, over them."""
    sizes, dtype = [t.numel() for t in tensors], tensors[0].dtype
    if fragments:
        first = sum(b - a for _, a, b in fragment_ranges(sizes, fragments)[0])  # what the first fragment sends
        collectives.allreduce_(torch.zeros(first, dtype=dtype), name=f"{name}.fragment", op=hvd.Sum,
                               process_set=world.process_set)
        return
    plan = world.plan
    route = next(filter(None, (plan.global_route(s) for s in range(step + 1, step + 1 + plan.policy.global_every))),
                 None)
    across = None if route is None else registry.get(world.scope.to_global(route.group))
    if across is not None:
        collectives.allreduce_(torch.zeros(sum(sizes) if route.speaks else 1, dtype=dtype),
                               name=f"{name}.across.{across.process_set_id}", op=hvd.Sum, process_set=across)
        # Every rank leaves the warm together: the others would start the waited half a model's crossing ahead of
        # the speakers and wait for them in its first route, timed (1.5-2.0 s on the bench, 1.0-1.4 s unwarmed).
        collectives.allreduce_(torch.zeros(1), name=f"{name}.together", op=hvd.Sum, process_set=world.process_set)
