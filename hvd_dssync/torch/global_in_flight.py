"""A global average in flight through the rack averages that follow it (``overlap=True`` on racks).

Over every rank a global average crosses the slow links, and one averaging period of compute rarely hides it;
the rack averages that follow cross nothing. So at a global step every rack first averages (waited for, on
its fast links: every member then holds its rack's model ``m``), and one op over every rank averages those
(``G``, the exact mean of every rank's model, whatever the racks' sizes). That op runs behind the local
steps and the rack averages that follow, up to the next average that is not inside the racks (the next
global one), where every rank waits for it.

Each rank folds it in once it is done (a poll, never a wait, at every step): ``model += G - m``, the same
correction on every member of a rack, which keeps the progress made meanwhile, the racks' averages included.
Members fold at different steps; a rack average among them averages what each holds less the correction it
has folded (:meth:`GlobalInFlight.unfolded`), and each adds its own back, so every member ends where it
would have, had all folded together. Rank-local reads (evaluating the model, ``state_dict``) fold it in
with no other op.
"""
import time

import horovod.torch as hvd
import torch

from ..plan import ring_allreduce_bytes
from ..world import Done
from . import collectives

__all__ = ["GlobalInFlight"]


class GlobalInFlight:
    """This rank's global average in flight, and the correction it folded while the others may not have yet.

    Example::

        flight = GlobalInFlight()
        flight.start(world, guard, tensors, action, step, "dssync.0.global")
        done = flight.fold(world, guard, tensors)                 # at each step: folds it in once done
        sent = flight.unfolded([t.clone() for t in tensors])      # what a rack average sends meanwhile
        done = flight.close(world, guard, tensors)                # where the next average leaves the racks
    """

    def __init__(self):
        self._pending = None  # (handle, sent, received, signature, action, step, bytes)
        self._folded = None  # the correction this rank folded while the window is open: G - m

    @property
    def in_flight(self):
        """Whether the op is in flight, not yet folded in on this rank."""
        return self._pending is not None

    @property
    def open(self):
        """Whether the window is open: the op in flight, or folded here and maybe not on the rack's others."""
        return self._pending is not None or self._folded is not None

    def start(self, world, guard, tensors, action, step, name):
        """Issue the average over the optimizer's ranks of ``tensors`` (this rank's rack's model, the same on
        every member) with the step's signature, as op ``name`` and the set's number."""
        sent = [t.detach().clone() for t in tensors]
        received = [s.clone() for s in sent]
        signature = guard.signature(world, tensors, step)
        handle = hvd.grouped_allreduce_async_(received + [signature], op=hvd.Average, process_set=world.process_set,
                                              name=f"{name}.{world.process_set.process_set_id}")
        nbytes = ring_allreduce_bytes(world.scope.world_size, sum(t.numel() * t.element_size() for t in tensors))
        self._pending = (handle, sent, received, signature, action, step, nbytes)

    def fold(self, world, guard, tensors, wait=False):
        """Fold the average into ``tensors`` (the live model) where it is done, or, with ``wait``, once it is.
        Returns what it did (:class:`hvd_dssync.world.Done`: its seconds are the wait here, what it delayed
        training beyond the global step's own), or None."""
        if self._pending is None or not (wait or hvd.poll(self._pending[0])):
            return None
        handle, sent, received, signature, action, step, nbytes = self._pending
        self._pending = None
        started = time.perf_counter()
        with guard.bounded(world, action, step):
            collectives.wait(handle)
        guard.check(world, signature * len(action.group), action, world.process_set, step)
        with torch.no_grad():
            for tensor, before, averaged in zip(tensors, sent, received):
                correction = averaged.sub_(before)
                tensor.add_(correction)
        self._folded = received
        return Done(action, time.perf_counter() - started, nbytes)

    def close(self, world, guard, tensors):
        """Every rank at the same step: fold it in (waiting where it is not done) and close the window."""
        done = self.fold(world, guard, tensors, wait=True)
        self._folded = None
        return done

    def unfolded(self, tensors):
        """``tensors`` (copies of the live model, sent to a rack average while the window is open) less the
        correction this rank has folded, in place; the rack average's outcome gets it back where the live
        model is moved by what the average moved them (``model += average - sent``). Returns them."""
        return self._shift(tensors, -1)

    def refolded(self, tensors):
        """After a waited rack average of :meth:`unfolded` live tensors: this rank's correction back in."""
        return self._shift(tensors, 1)

    def _shift(self, tensors, sign):
        if self._folded is not None:
            with torch.no_grad():
                for t, correction in zip(tensors, self._folded):
                    t.add_(correction, alpha=sign)
        return tensors

    def drop(self):
        """The world changed (elastic reset) or every rank folded it (the racks change): nothing left."""
        self._pending = None
        self._folded = None
