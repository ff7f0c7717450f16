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

__all__ = ["StepGuard", "SIGNATURE_LENGTH"]

SIGNATURE_LENGTH = len(step_signature(0))


class StepGuard:
    """The signature of ``owner``'s steps and the watchdog over its waits.

    ``owner`` is the DS-Sync optimizer: the guard reads its step (``sync_step``), its scope, its op names
    (``_name``) and what it knows of joined ranks (``_joins``), which can change when the world changes.

    Example::

        guard = StepGuard(optimizer)
        signature = guard.signature(tensors)
        with guard.bounded(action, optimizer.sync_step):
            collectives.grouped_allreduce_(tensors + [signature], name=name, op=hvd.Average, process_set=ps)
        guard.check(signature * len(action.group), action, ps, optimizer.sync_step)
    """

    def __init__(self, owner):
        self._owner = owner
        self.watchdog = process_watchdog(hvd.shutdown)

    def signature(self, tensors):
        """What rides along with an average: the step's signature, then what this rank knows of ranks that
        ran out of data. In float32 when the tensors are float32: Horovod fuses a grouped allreduce by
        dtype, so another dtype would cost a second collective every step."""
        owner = self._owner
        dtype = torch.float32 if tensors and tensors[0].dtype == torch.float32 else torch.float64
        return torch.from_numpy(np.concatenate([step_signature(owner.sync_step), owner._joins.payload()])).to(dtype)

    def check(self, sums, action, process_set, step):
        """Take in what rode along with an average (see :meth:`signature`): the joins the members knew of, and
        a check that they were at the same step, which raises on every member if not.

        ``sums`` are the members' signatures summed; only when the steps differ does a second collective
        (among the members, who all found out together) gather who was at which step, for the error.
        """
        sums = sums.double().numpy()
        self._owner._joins.merge(sums[SIGNATURE_LENGTH:] / len(action.group))
        if not steps_differ(sums[:SIGNATURE_LENGTH], len(action.group)):
            return
        with self.bounded(action, step):
            gathered = hvd.allgather(torch.tensor([[hvd.rank(), step]]), name=f"{self._owner._name}.drift",
                                     process_set=process_set)
        raise RuntimeError(describe_step_drift({rank: s for rank, s in gathered.tolist()}))

    @contextlib.contextmanager
    def bounded(self, action, step):
        """Bound the wait for ``action``'s group (see :mod:`hvd_dssync.watchdog`); name it if it expires."""
        what = describe_wait(hvd.rank(), self._owner._scope.to_global(action.group), step, action.kind)
        try:
            with self.watchdog.watching(what):
                yield
        except Exception as e:  # Horovod's error after the watchdog shut it down: say why instead
            if self.watchdog.expired is None:
                raise
            self.watchdog.wait_for_shutdown()
            raise RuntimeError(self.watchdog.expired) from e
