"""The step guard: what rides along with every average, and the watchdog's bound on every wait.

Every average carries the step's signature and what its sender knows of ranks that ran out of data
(:mod:`hvd_dssync.join`), so that the members of a group find out, all together, when they are at
different steps (:mod:`hvd_dssync.guards`); every wait for a group is bounded (:mod:`hvd_dssync.watchdog`).
"""
import contextlib

import horovod.torch as hvd
import numpy as np
import torch

from ..guards import describe_step_drift, step_signature, steps_differ
from ..watchdog import describe_wait, process_watchdog
from . import collectives

__all__ = ["StepGuard", "SIGNATURE_LENGTH"]

SIGNATURE_LENGTH = len(step_signature(0))


class StepGuard:
    """The signature of an optimizer's steps and the watchdog over its waits.

    Each call gets the :class:`hvd_dssync.world.World` it runs in (the scope names the group a wait is
    for; the joins are what this rank knows of ranks that ran out of data) and the step.

    Example::

        guard = StepGuard(name="dssync.0")
        guard.average(world, tensors, action, ps, name, step)     # all of the below, waited for
        signature = guard.signature(world, tensors, step)
        with guard.bounded(world, action, step):
            collectives.grouped_allreduce_(tensors + [signature], name=name, op=hvd.Average, process_set=ps)
        guard.check(world, signature * len(action.group), action, ps, step)
    """

    def __init__(self, name):
        self.name = name  # the optimizer's op names
        self.watchdog = process_watchdog(hvd.shutdown)

    def signature(self, world, tensors, step):
        """What rides along with an average: the step's signature, then what this rank knows of ranks that
        ran out of data. In float32 when the tensors are float32: Horovod fuses a grouped allreduce by
        dtype, so another dtype would cost a second collective every step."""
        dtype = torch.float32 if tensors and tensors[0].dtype == torch.float32 else torch.float64
        return torch.from_numpy(np.concatenate([step_signature(step), world.joins.payload()])).to(dtype)

    def average(self, world, tensors, action, process_set, name, step):
        """Average ``tensors`` in place over ``process_set`` (``action``'s group) with the step's signature riding
        along, the wait bounded, then :meth:`check` what rode along."""
        signature = self.signature(world, tensors, step)
        with self.bounded(world, action, step):
            collectives.grouped_allreduce_(tensors + [signature], name=name, op=hvd.Average, process_set=process_set)
        self.check(world, signature * len(action.group), action, process_set, step)

    def check(self, world, sums, action, process_set, step):
        """Take in what rode along with an average (see :meth:`signature`): the joins the members knew of, and
        a check that they were at the same step, which raises on every member if not.

        ``sums`` are the members' signatures summed; only when the steps differ does a second collective
        (among the members, who all found out together) gather who was at which step, for the error.
        """
        sums = sums.double().numpy()
        world.joins.merge(sums[SIGNATURE_LENGTH:] / len(action.group))
        if not steps_differ(sums[:SIGNATURE_LENGTH], len(action.group)):
            return
        with self.bounded(world, action, step):
            gathered = hvd.allgather(torch.tensor([[hvd.rank(), step]]), name=f"{self.name}.drift",
                                     process_set=process_set)
        raise RuntimeError(describe_step_drift({rank: s for rank, s in gathered.tolist()}))

    def take_joins(self, world, sums):
        """Take in the joins that rode along a sum in which one member sent its :meth:`signature` and the
        others zeros (the last average of a global average through the racks): what that member knew."""
        world.joins.merge(sums.double().numpy()[SIGNATURE_LENGTH:])

    @contextlib.contextmanager
    def bounded(self, world, action, step):
        """Bound the wait for ``action``'s group (see :mod:`hvd_dssync.watchdog`); name it if it expires."""
        what = describe_wait(hvd.rank(), world.scope.to_global(action.group), step, action.kind)
        try:
            with self.watchdog.watching(what):
                yield
        except Exception as e:  # Horovod's error after the watchdog shut it down: say why instead
            if self.watchdog.expired is None:
                raise
            self.watchdog.wait_for_shutdown()
            raise RuntimeError(self.watchdog.expired) from e
