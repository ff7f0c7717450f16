"""Averaging for the PyTorch adapter: the model inside a step's group (the warm-up's gradients: :mod:`.warmup`).

A step's average is one grouped allreduce of the parameters the optimizer trains and the model's
floating-point buffers, on the Horovod process set of the step's group, with the step guard's signature
riding along. Around it: the window's process sets, exact bridges (a bridge rank's move carried into its
rack's next average), averaging in flight (``overlap``), the reference for lossy compression, and the outer
step (:mod:`.outer_step`).
"""
import collections
import time

import horovod.torch as hvd
import torch

from ..differences import compress_difference, mix_difference
from ..fragments import fragment_count, fragment_ranges
from ..overlap import folds_now
from ..plan import GLOBAL, GROUP, LOCAL, carry_fate, ring_allreduce_bytes, routes_global_averages
from ..world import Done
from . import collectives
from .in_flight import Fragments, InFlight, agreed_with_parts, copy_into, fits, send_fragment, whole_moves
from .outer_step import OuterStep

__all__ = ["Averaging"]


class Averaging:
    """How the model is averaged.

    Each call gets the :class:`hvd_dssync.world.World` it runs in (the plan, the scope, the optimizer's
    process set: elastic Horovod can replace them) and the step, and returns what it did
    (:class:`hvd_dssync.world.Done`); the parts it works with are given here.

    Args:
        optimizer: the optimizer whose ``param_groups`` say which parameters train.
        named_parameters: ``(name, parameter)`` of the model, as the optimizer was given them.
        name: the optimizer's op names.
        registry: the process sets of the schedule's groups (:class:`hvd_dssync.process_sets.ProcessSetRegistry`).
        guard: the step guard (:class:`.step_guard.StepGuard`).
        sparse: the sparse rows of embedding tables (:class:`.sparse_rows.SparseRows`).
        adaptive: the adaptive policy's figures (:class:`.adaptive_step.AdaptiveStep`).
        model: the module whose floating-point buffers are averaged too, or None.
        average_buffers: False keeps the buffers local.
        overlap: start the average asynchronously; it runs through the local steps that follow and is folded
            in once done, at the latest where the next average starts (a global one a step after it started:
            :func:`hvd_dssync.overlap.folds_now`). Given True, a global average on racks goes over every rank
            at once, behind the steps, where the route is "auto" (asked for, the route is kept, waited for), in
            ``global_fragments`` fragments (1 unless :data:`hvd_dssync.fragments.FRAGMENTS_ENV` says more). The
            default's trial sets ``overlap`` and ``global_fragments`` per step
            (:class:`.overlap_choice.OverlapChoice`: 0, the route, unless it chose the global averages in
            flight).
        compression: Horovod's compression; a lossy one averages differences from a shared reference.
        outer_momentum: momentum of the outer step after each average (0: plain averaging).

    Example::

        averaging = Averaging(optimizer, named_parameters, "dssync.0", registry, guard, sparse, adaptive,
                              model, average_buffers=True, overlap=False, compression=hvd.Compression.none,
                              outer_momentum=0.0)
        done = averaging.average_model(world, plan.action(step), step)
    """

    def __init__(self, optimizer, named_parameters, name, registry, guard, sparse, adaptive, model, average_buffers,
                 overlap, compression, outer_momentum):
        self.optimizer = optimizer
        self.named_parameters = list(named_parameters)
        self.name = name
        self.registry = registry
        self.guard = guard
        self.sparse = sparse
        self.adaptive = adaptive
        self.model = model
        self.average_buffers = average_buffers
        self.overlap = overlap
        # overlap=True: the global averages too, over every rank at once ("auto"), in this many fragments, each
        # sent at a step of its own and folded in at the next (0: through the racks, waited for).
        self.global_fragments = int(bool(overlap))
        self._fragments = None  # a global average in flight in fragments: what the next steps send (Fragments)
        self.compression = compression
        self.outer = OuterStep(outer_momentum)  # the checkpoint saves and loads its state
        # The last averaged model all ranks share, for lossy compression (see _average_differences).
        self._reference = None
        self._pending = None
        self._carry = None  # what an exact bridge left to add to this rank's next group average
        self._agreed = None  # the model right after this rank's last average: what an exact bridge sends
        self._in_flight = None  # overlap: the buffers of an average in flight, kept for the next (_buffers_for)
        # Called with what each fold of an average in flight added to the model (the optimizer's
        # register_fold_hook).
        self.fold_hooks = collections.OrderedDict()

    def tensors(self):
        """``(name, tensor)`` of what a step averages, looked up now: the parameters the optimizer trains and
        the model's floating-point buffers.

        Frozen parameters and those the optimizer does not train never change locally. Buffers are looked
        up at each step because ``model.to()``, ``.half()`` or SyncBatchNorm conversion replace them.
        """
        trained = {id(p) for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad}
        tensors = [(name, p) for name, p in self.named_parameters if id(p) in trained]
        if self.model is not None and self.average_buffers:
            tensors += [(f"buffer.{name}", b) for name, b in self.model.named_buffers() if b.is_floating_point()]
        return tensors

    def forget(self):
        """The world changed: the average in flight died with it, the reference is set again, and a bridge's
        carry (for racks of the old world) is dropped."""
        self._pending = None
        self._fragments = None
        self._in_flight = None
        self._reference = None
        self._carry = None
        self._agreed = None

    def follow_schedule(self):
        """The optimizer follows another schedule (the racks sensed again): a bridge's carry, for the racks of
        the old one, is dropped. Nothing is in flight (the optimizer finished it)."""
        self._carry = None
        self._agreed = None
        self._fragments = None

    def drop_pending(self):
        """Horovod was re-initialized (elastic reset): the average in flight died with the old world, and the
        model keeps this rank's own update."""
        self._pending = None
        self._fragments = None
        self._in_flight = None  # what the old world's op may still write into

    @property
    def in_flight(self):
        """Whether an average runs behind the local steps (``overlap``), not yet folded in."""
        return self._pending is not None

    @property
    def ordered_sets(self):
        """Whether the groups' sets may be marked ordered (:mod:`hvd_dssync.process_sets`): not where sparse
        averaging gathers rows on them."""
        return not self.sparse.enabled

    def enter_window(self, world, step):
        """Register the process sets of the schedule's window at this step and release the last window's, when
        the step enters a new window (collectives: every rank at the same step)."""
        change = world.plan.window_change(step)
        if change is not None and not world.in_process_set:
            acquire, release = change
            self.registry.acquire(acquire, ordered=self.ordered_sets)
            self.registry.release(release)

    def average_model(self, world, action, step):
        """The step's average of the model inside ``action``'s group (every rank of the scope at the same step).

        Returns what this step's synchronization did (:class:`hvd_dssync.world.Done`): with ``overlap``, the
        average folded in at this step (None at the first average), since this step's is in flight.
        """
        guard, sparse = self.guard, self.sparse
        if action.kind == LOCAL:  # every rank takes its local steps together: no op on any rank
            # An average in flight runs on through the local steps and is folded in once done (a poll), at the
            # latest where the next average starts; a global one a step after it started (folds_now).
            # A global average in fragments sends its next one after the last is folded in.
            pending = self._pending
            due = pending is not None and folds_now(pending.action.kind, pending.step, step, hvd.poll(pending.handle))
            landed = self.finish_pending(world) if due else None
            if self._fragments is not None:
                self._send_fragment(world, step)
            return Done(action) if landed is None else landed
        finished = self.finish_pending(world)
        self._fragments = None  # one not sent before the next average (a fragment a step at most: none)
        carry, self._carry = (self._carry if carry_fate(action.kind) == "add" else None), None
        self.enter_window(world, step)
        if self.compression is not hvd.Compression.none and self._reference is None:
            return self._establish_reference(world, action, step)
        route = world.plan.global_route(step)
        # The tables averaged by their rows are agreed by every rank at the first step after the warm-up. With
        # overlap=True a global average goes over every rank at once where the route is "auto": its ops run
        # behind the local steps, the route's three would each wait for the one before. The trial of overlap
        # chooses (global_fragments): in as many fragments as hide behind a step each, or through the racks
        # where even a period's steps would not hide them (docs/tuning.md).
        if route is not None and routes_global_averages(
                world.plan.schedule, "PyTorch", lossy_compression=self.compression is not hvd.Compression.none,
                adaptive=world.plan.adaptive is not None, sparse=sparse.row_sets is not None,
                overlapped=bool(self.global_fragments)):
            return self._average_through_racks(world, action, step, route)
        process_set = self._process_set_of(world, action)
        if process_set is None:
            return Done(action)
        if len(action.group) == 1:
            # Nobody to average with, so the model stays put; tiny ops on this rank's own set all the same,
            # as many as a group's members issue (sparse averaging gathers the row sets first), since Horovod
            # names a user's unnamed ops by counting every op of the process: every rank must issue as many
            # ops as the others.
            for k in range(1 if sparse.row_sets is None else 2):
                collectives.allreduce_(torch.zeros(1), name=f"{self.name}.alone.{k}", op=hvd.Sum,
                                       process_set=process_set)
            return Done(action)
        named = [(n, t.data) for n, t in self.tensors()]
        name = f"{self.name}.{action.kind}.{process_set.process_set_id}"
        writes, gathered_bytes, unions = [], 0, None
        if sparse.row_sets is not None:
            with guard.bounded(world, action, step):
                named, writes, gathered_bytes, unions = sparse.rows_to_average(named, action, process_set, name)
        tensors = [t for _, t in named]
        bridge = world.plan.bridge(step) if sparse.row_sets is None else None  # rows: the bridge averages plainly
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sent_bytes = ring_allreduce_bytes(len(action.group), nbytes) + gathered_bytes
        # Rides along, uncompressed, so that the members find out if they are at different steps.
        signature = guard.signature(world, tensors, step)
        started = time.perf_counter()
        # A global average on racks goes in flight where it does not take the route (global_fragments), the
        # others where overlap is on: the trial may keep the global averages' fragments alone.
        in_flight = bool(self.global_fragments) if route is not None else self.overlap
        if in_flight and self._fragmented(world, action, step, tensors, bridge):
            ranges = fragment_ranges([t.numel() for t in tensors], self._fragment_count(world, step))
            self._fragments = Fragments(action, step, process_set, name, ranges, [t.numel() for t in tensors])
            self._send_fragment(world, step)
            return finished
        if in_flight:
            copy, received = self._buffers_for(tensors)
            sent = self._agreed_models(tensors) if bridge is not None else copy_into(copy, tensors)
            received = self._contribution(copy_into(received, sent), bridge, carry)
            handle = hvd.grouped_allreduce_async_(received + [signature], name=name, op=hvd.Average,
                                                  process_set=process_set)
            self._pending = InFlight(handle, [n for n, _ in named], tensors, sent, received, signature, action,
                                      step, process_set, time.perf_counter() - started, sent_bytes, bridge)
            return finished
        self._in_flight = None  # waited for: no buffers kept (overlap off, or the trial's waited half)
        # A bridge averages copies of the model this rank agreed on with its rack; anything else, the model.
        sent = self._agreed_models(tensors) if bridge is not None else None
        work = self._contribution(tensors if sent is None else [t.clone() for t in sent], bridge, carry)
        with guard.bounded(world, action, step):
            if self.compression is hvd.Compression.none and world.plan.adaptive is not None:
                signature = self.adaptive.average(world, step, work, signature, name, process_set, action)
            elif self.compression is hvd.Compression.none:
                collectives.grouped_allreduce_(work + [signature], name=name, op=hvd.Average,
                                               process_set=process_set)
            else:
                sent_bytes, signature = self._average_differences(work, action, process_set, name, signature)
        guard.check(world, signature * len(action.group), action, process_set, step)
        if sent is not None:
            self._cross(tensors, sent, work, bridge)
        with torch.no_grad():
            for table, index, rows in writes:
                table.index_copy_(0, index, rows)
        if unions is not None:
            sparse.averaged(unions, action)
        self._outer_step()
        self._remember(world, tensors)
        return Done(action, time.perf_counter() - started, sent_bytes,
                    sparse_rows=sum(len(index) for _, index, _ in writes),
                    folded=None if finished is None else finished.folded)

    def _fragmented(self, world, action, step, tensors, bridge):
        """Whether ``action``'s average at ``step`` goes in fragments (:attr:`global_fragments`): a global one of a
        plain model (no bridge, no outer step, no rows: those fold a whole model), each tensor one block of memory."""
        return (action.kind == GLOBAL and self._fragment_count(world, step) > 1 and bridge is None
                and not self.outer.momentum and self.sparse.row_sets is None
                and self.compression is hvd.Compression.none and all(t.is_contiguous() for t in tensors))

    def _fragment_count(self, world, step):
        """How many fragments ``step``'s global average goes in: at most a step each until the next average."""
        return fragment_count(self.global_fragments, world.plan.policy.steps_to_next_average(step))

    def _send_fragment(self, world, step):
        """Send the fragment of the global average in fragments that is due at ``step`` (every rank of the scope
        at the same step), into the buffers of an average in flight; after the last one, or where the steps or
        the model's tensors are not those it started with (a checkpoint loaded, the model moved), none is left."""
        fragments = self._fragments
        if self._pending is not None:  # the fragment before is folded in at this step (folds_now)
            raise RuntimeError("hvd_dssync: a fragment of a global average was sent before the last one was folded in")
        k = step - fragments.step
        named = [(name, t.data) for name, t in self.tensors()]
        if not 0 <= k < len(fragments.ranges) or [t.numel() for _, t in named] != fragments.sizes:
            self._fragments = None
            return
        if k == len(fragments.ranges) - 1:
            self._fragments = None
        self._pending = send_fragment(fragments, k, named, self._buffers_for([t for _, t in named]),
                                      lambda tensors: self.guard.signature(world, tensors, step), step)

    def _live(self):
        """The tensors a step averages, as they are now (:meth:`tensors`' data)."""
        return [t.data for _, t in self.tensors()]

    def _average_through_racks(self, world, action, step, route):
        """A global average through the racks (:class:`hvd_dssync.schedules.GlobalRoute`), waited for: the
        rack's average; the speakers' average of their racks' (scaled), beside which every other rank issues
        a tiny op in its group of the bridge step, so that every rank issues as many ops; then each rack's sum
        of what its speaker holds and zeros. The step's signature rides along the first two, the joins the
        speaker knows along the third. Every rank ends with the mean of every rank's model (exactly where
        the racks are of one size: the scale is then 1)."""
        tensors = self._live()
        # Each of the three averages is the global one's (its kind, in what a wait that expires says), among
        # the members of its own op: the ranks this rank waits for there.
        rack, across = action._replace(group=route.rack), action._replace(group=route.group)
        rack_set = self._process_set_of(world, rack._replace(kind=GROUP))
        across_set = self._process_set_of(world, across._replace(kind=GROUP))
        name = f"{self.name}.global"
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sent_bytes = 2 * ring_allreduce_bytes(len(route.rack), nbytes)
        started = time.perf_counter()
        self.guard.average(world, tensors, rack, rack_set, f"{name}.rack.{rack_set.process_set_id}", step)
        across_name = f"{name}.across.{across_set.process_set_id}"
        if route.speaks:
            with torch.no_grad():
                for t in tensors:
                    t.mul_(route.scale)
            self.guard.average(world, tensors, across, across_set, across_name, step)
            sent_bytes += ring_allreduce_bytes(len(route.group), nbytes)
            signature = self.guard.signature(world, tensors, step)
        else:
            with self.guard.bounded(world, across, step):
                collectives.allreduce_(torch.zeros(1), name=across_name, op=hvd.Sum, process_set=across_set)
            with torch.no_grad():
                for t in tensors:
                    t.zero_()
            signature = torch.zeros_like(self.guard.signature(world, tensors, step))
        with self.guard.bounded(world, rack, step):
            collectives.grouped_allreduce_(tensors + [signature], name=f"{name}.back.{rack_set.process_set_id}",
                                           op=hvd.Sum, process_set=rack_set)
        self.guard.take_joins(world, signature)
        self._outer_step()
        self._remember(world, tensors)
        return Done(action, time.perf_counter() - started, sent_bytes)

    def finish_pending(self, world):
        """Fold in an average still in flight (``overlap=True``) as a correction that keeps the local progress
        made since it started (``model += average - sent``; an exact bridge's move and carry alike); waits for
        it where it is not done. Returns what it did (:class:`hvd_dssync.world.Done`: its seconds are what it
        delayed training, issuing it and waiting for it here, not its time in flight), or None if nothing was
        in flight."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        action, step, tensors, bridge = pending.action, pending.step, pending.tensors, pending.bridge
        started = time.perf_counter()
        with self.guard.bounded(world, action, step):
            collectives.wait(pending.handle)
        self.guard.check(world, pending.signature * len(action.group), action, pending.process_set, step)
        if bridge is not None:
            self._cross(tensors, pending.sent, pending.received, bridge, fold_names=pending.names)
        else:
            with torch.no_grad():  # the difference into the copy of what was sent, which is not read again
                moves = [torch.sub(averaged, before, out=before)
                         for before, averaged in zip(pending.sent, pending.received)]
                for tensor, move in zip(tensors, moves):
                    tensor.add_(move)
            self._tell_fold_hooks(pending.names, moves, pending.parts)
        self._outer_step()
        # What the next exact bridge sends is the group's average, the same on every member, as where the
        # average is waited for; the live model also holds this rank's steps since the average was sent.
        if pending.parts is None:
            self._remember(world, tensors if bridge is not None else pending.received)
        elif world.plan.schedule.has_bridges:
            self._agreed = agreed_with_parts(self._agreed, self.tensors(), pending.parts, pending.received)
        return Done(action, pending.issued + time.perf_counter() - started, pending.nbytes, overlapped=True,
                    folded=(action.kind, step))

    def _tell_fold_hooks(self, names, moves, parts=None):
        """Tell the fold hooks what a fold added to each tensor (``names``: what the tensors are; ``parts``: those
        of a fragment, whose moves the hooks are told as whole tensors)."""
        if self.fold_hooks:
            named = list(zip(names, moves)) if parts is None else whole_moves(parts, moves)
            for hook in list(self.fold_hooks.values()):
                hook(named)

    def _agreed_models(self, tensors):
        """This rank's model as of its last average (a copy of its live model before the first one), to be
        read only: :meth:`_remember` writes it after the bridge's move is taken."""
        if not fits(self._agreed, tensors):
            return [t.detach().clone() for t in tensors]
        return self._agreed

    def _buffers_for(self, tensors):
        """Two buffers shaped as ``tensors`` for an average to run in flight: what this rank sends, and what it
        receives. The last average's are used again while the model keeps its shapes (nothing is in flight
        when an average starts): allocating them at each average cost several times the copies into them."""
        if self._in_flight is None or not fits(self._in_flight[0], tensors):
            self._in_flight = tuple([torch.empty_like(t) for t in tensors] for _ in range(2))
        return self._in_flight

    def _remember(self, world, tensors):
        """After an average: keep the model it left, which this rank's next exact bridge sends (into the same
        buffers, as long as the model keeps its shapes)."""
        if not world.plan.schedule.has_bridges or self.sparse.row_sets is not None:
            return
        if fits(self._agreed, tensors):
            with torch.no_grad():
                for a, t in zip(self._agreed, tensors):
                    a.copy_(t)
        else:
            self._agreed = [t.detach().clone() for t in tensors]

    def _cross(self, tensors, sent, averaged, bridge, fold_names=None):
        """An exact bridge's average is in: move the model (``tensors``) by what it moved the agreed model
        (``sent``, unscaled) and keep ``bridge.carry`` times that move for the next group average. ``fold_names``:
        the tensors' names where this is the fold of an average in flight, whose moves the fold hooks are told
        before the carry is scaled."""
        with torch.no_grad():
            moves = [a - s for a, s in zip(averaged, sent)]
            for t, move in zip(tensors, moves):
                t.add_(move)
        if fold_names is not None:
            self._tell_fold_hooks(fold_names, moves)
        self._carry = [move.mul_(bridge.carry) for move in moves] if bridge.carry else None

    @staticmethod
    def _contribution(tensors, bridge, carry):
        """Make ``tensors`` (in place) what this rank sends: plus the carry an exact bridge left, times the
        bridge's scale when this step is one (:meth:`hvd_dssync.plan.SyncPlan.bridge`). Returns them."""
        with torch.no_grad():
            for k, t in enumerate(tensors):
                if carry is not None:
                    t.add_(carry[k])
                if bridge is not None and bridge.scale != 1.0:
                    t.mul_(bridge.scale)
        return tensors

    def _process_set_of(self, world, action):
        """The Horovod process set of ``action``'s group (positions in the scope); ``None``: nothing to average."""
        if action.kind == GLOBAL or len(action.group) == world.scope.world_size:
            return world.process_set
        if world.in_process_set and len(action.group) == 1:
            return None  # a group of one keeps its model; no set was registered for it
        return self.registry.get(world.scope.to_global(action.group))

    def _establish_reference(self, world, action, step):
        """The first averaging step under lossy compression: an exact average over the scope sets the reference.

        Every rank of the scope reaches its first averaging step at the same step, whatever its group.
        """
        size, process_set = world.scope.world_size, world.process_set
        tensors = self._live()
        started = time.perf_counter()
        everyone = action._replace(kind=GLOBAL, group=tuple(range(size)))
        self.guard.average(world, tensors, everyone, process_set,
                           f"{self.name}.reference.{process_set.process_set_id}", step)
        self._reference = [t.detach().clone() for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return Done(everyone, time.perf_counter() - started, ring_allreduce_bytes(size, nbytes))

    def _average_differences(self, tensors, action, process_set, name, signature):
        """Average the group's models through their compressed differences from the shared reference
        (:mod:`hvd_dssync.differences`: what each rank sends and keeps, and when the reference moves).

        The reference must be the same on every member: set by an exact average over the scope
        (:meth:`_establish_reference`), moved by global averages only. The step signature rides along
        uncompressed. Returns the bytes sent and the averaged signature.
        """
        compression = self.compression
        sent = [compress_difference(t, r, compression) for t, r in zip(tensors, self._reference)]
        *averaged, signature = collectives.grouped_allreduce([c for _, c, _ in sent] + [signature], name=name,
                                                             op=hvd.Average, process_set=process_set)
        for t, r, a, (d, c, ctx) in zip(tensors, self._reference, averaged, sent):
            kept, received = mix_difference(r, a, d, c, ctx, compression)
            t.copy_(kept)
            if action.kind == GLOBAL:
                r.add_(received)
        nbytes = sum(c.numel() * c.element_size() for _, c, _ in sent)
        return ring_allreduce_bytes(len(action.group), nbytes), signature

    def _outer_step(self):
        """The outer step after an average (:class:`.outer_step.OuterStep`), on the trained parameters."""
        if self.outer.momentum:
            self.outer.take([t.data for name, t in self.tensors() if not name.startswith("buffer.")])

    def carry_state(self):
        """What exact bridges need of the past, copied (None if nothing): the carry waiting for this rank's
        next group average, and the model its last average left."""
        if self._carry is None and self._agreed is None:
            return None
        return {"carry": None if self._carry is None else [c.clone() for c in self._carry],
                "agreed": None if self._agreed is None else [a.clone() for a in self._agreed]}

    def load_carry_state(self, state):
        """What :meth:`carry_state` saved (None: nothing)."""
        state = state or {}
        self._carry = None if state.get("carry") is None else list(state["carry"])
        self._agreed = None if state.get("agreed") is None else list(state["agreed"])
