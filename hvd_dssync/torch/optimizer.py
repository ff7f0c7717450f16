"""DS-Sync ``DistributedOptimizer`` for PyTorch: Horovod's signature, DS-Sync's step.

One training step, in order: the wrapped optimizer steps on this rank's own gradient; the model
(parameters and floating-point buffers) is averaged inside this step's group with one grouped allreduce
on the group's Horovod process set; the step is counted. During a bulk-synchronous warm-up the step is
Horovod's instead: gradients are averaged over all ranks first, and no model averaging follows.

Elastic Horovod: when ``hvd.elastic.run`` re-initializes Horovod for a new world, the next ``step()``
notices it (this rank, the world size or the registered process sets changed), rebuilds the schedule for
the new world, checks again that all ranks agree, and continues from rank 0's step.
"""
import collections
import contextlib
import functools
import itertools
import math
import os
import sys
import time
import warnings
import weakref

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch import functions as hvd_functions

from ..adaptive import AdaptivePolicy, decode_figures, drift_of, encode_figures
from ..guards import check_nccl_process_sets, describe_step_drift, step_signature, steps_differ
from ..join import JoinState
from ..plan import (BSP, GLOBAL, GROUP, LOCAL, Action, SyncPlan, agreement_fields, agreement_payload,
                    arguments_for_world, check_agreement, check_horovod_arguments, resolve_schedule,
                    ring_allreduce_bytes)
from ..process_sets import elastic_job, registry_for
from ..scope import acquire_registered, scope_of
from ..sparse import RowSets, allgather_bytes, average_densely, pack_rows, unpack_unions
from ..topology import loopback_hostname_warning
from ..watchdog import describe_wait, drain_at_exit, exit_timeout, process_watchdog
from . import collectives
from .outside import OutsideProcessSet

__all__ = ["DistributedOptimizer"]

# Optimizers with an averaging in flight (overlap=True): synchronize_models() completes them first.
_live_optimizers = weakref.WeakSet()
_exit = {"drain_registered": False}
# Each optimizer's ops carry its process set and its number in construction order among the optimizers of
# that set, the same on every member (ranks outside a set build none of its optimizers), so that two
# optimizers' averages in flight at once never share an op name.
_construction_order = collections.defaultdict(itertools.count)
_constructions = itertools.count()
# Every optimizer's step() calls, counted together: the order in which a training loop steps its optimizers.
_step_ticks = itertools.count()
# Every average carries the step's signature, then what its sender knows of joined ranks (_signature).
SIGNATURE_LENGTH = len(step_signature(0))
# Horovod's warning, word for word, so that scripts see what they know.
SYNCHRONIZE_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                       "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                       "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


def _watch_until_exit(optimizer):
    """Track ``optimizer``; once per process, arrange a drain before Horovod's own exit-time shutdown.

    Registered after ``hvd.init()`` (which registers Horovod's shutdown), so it runs first.
    """
    _live_optimizers.add(optimizer)
    if _exit["drain_registered"]:
        return
    _exit["drain_registered"] = True
    message = loopback_hostname_warning(hvd.cross_size())
    if message:
        warnings.warn(message)
    drain_at_exit(_drain_before_shutdown)


def _drain_before_shutdown():
    """Let every rank finish its last group average before any rank shuts Horovod down.

    Under DS-Sync the groups of the last step finish at different times; a rank that exits and shuts
    Horovod down while another group still averages makes that group's op fail. So a script that ends
    without a global collective gets one here: a named allreduce, waited for at most
    ``HVD_DSSYNC_EXIT_TIMEOUT`` seconds (default 30) so that a rank whose peers are stuck or gone still
    exits. Skipped after an uncaught exception (:func:`hvd_dssync.watchdog.drain_at_exit`).
    """
    if not hvd.is_initialized():
        return
    try:
        optimizers = list(_live_optimizers)
        for optimizer in optimizers:
            optimizer.finish_pending()
        handles = [hvd.allreduce_async(torch.zeros(1), name="dssync.exit", op=hvd.Sum, process_set=process_set)
                   for process_set in _exit_process_sets(optimizers)]
        deadline = time.monotonic() + exit_timeout()
        while not all(hvd.poll(h) for h in handles) and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # Horovod already shut down by a failing peer: nothing left to drain
        pass


def _exit_process_sets(optimizers):
    """Where the exit drain meets: all ranks, unless every optimizer trains inside a process set.

    Ranks outside a set may never build a DS-Sync optimizer, so they would not join a global drain; every
    member of a set has the same optimizers, so one drain per set, in id order, is met by all of them.
    """
    sets = {o.process_set.process_set_id: o.process_set for o in optimizers}
    if not sets or 0 in sets:
        return [hvd.global_process_set]
    return [sets[i] for i in sorted(sets)]


def _check_named_parameters(optimizer, named_parameters):
    """Horovod's rules: unique names, and every parameter of the optimizer named."""
    if named_parameters is None:
        return [(f"param.{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])]
    named_parameters = list(named_parameters)
    if any(not isinstance(p, tuple) or len(p) != 2 for p in named_parameters):
        raise ValueError("Arg ``named_parameters`` must be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters().")
    names = [name for name, _ in named_parameters]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Arg ``named_parameters`` has duplicate names: {', '.join(duplicates)}.")
    named = {id(p) for _, p in named_parameters}
    unnamed = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in named]
    if unnamed:
        raise ValueError(f"Arg ``named_parameters`` leaves {len(unnamed)} of the optimizer's parameters "
                         "unnamed; pass model.named_parameters() for the model the optimizer trains.")
    return named_parameters


class _DSSyncOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    # GradScaler then always calls step(), with ``grad_scale`` and ``found_inf`` set on the optimizer: a
    # rank whose gradient overflowed still takes part in its group's average (see _amp_scaling).
    _step_supports_amp_scaling = True

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, process_set, plan, plan_arguments, model,
                 average_buffers, overlap, scope, outer_momentum=0.0, sparse_average=True):
        super(self.__class__, self).__init__(params)
        self._named_parameters = named_parameters
        # Horovod's attributes, read by scripts and by Horovod's own tests.
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda item: item[0])}
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._synchronized = False
        self._should_synchronize = True
        self._plan_arguments = plan_arguments
        self._plan = plan
        self._model = model
        self._average_buffers = average_buffers
        self._overlap = overlap
        set_id = process_set.process_set_id
        self._constructed = next(_constructions)
        self._name = f"dssync.{next(_construction_order[set_id])}" if set_id == 0 else \
            f"dssync.set{set_id}.{next(_construction_order[set_id])}"
        self._scope = scope
        # The last averaged model all ranks share, for lossy compression (see _average_differences).
        self._reference = None
        self._outer_momentum = outer_momentum
        self._outer = None  # (anchors, momentum buffers) of the outer step, from the first average on
        self._registry = registry_for(hvd)
        self._generation = self._registry.refresh()
        self._pending = None
        self._step_settled = False
        self.sync_step = 0
        self.last_sync = None
        self._step_ended = None  # when the last step() returned, for the adaptive policy's compute time
        # When step() was last called and the time before, counted in calls to any optimizer's step(): which
        # optimizers a training iteration steps, and in what order (join()).
        self._step_tick = self._previous_tick = None
        self._joins = JoinState(scope.world_size)  # ranks known to have run out of data (hvd_dssync.join)
        # Sparse averaging of embedding tables (see hvd_dssync.sparse): which tables is agreed at the first
        # step after the warm-up; until then every rank's model is the same.
        self._sparse_average = sparse_average and not overlap and compression is hvd.Compression.none
        self._sparse_tables = None  # {name: parameter} once agreed
        self._row_sets = None
        self._loaded_rows = None  # sets from load_state_dict(), applied when the tables are agreed
        self._drift = float("nan")
        self._gathered_figures = None  # every rank's adaptive-policy figures, when they rode along an average
        # Under elastic Horovod a worker that joins builds its optimizer while the others are inside
        # hvd.elastic.run's state sync, so no collective may run here; the first step checks instead.
        self._world_check_pending = elastic_job()
        self._watchdog = process_watchdog(hvd.shutdown)
        if self._in_process_set():
            acquire_registered(hvd, scope, plan.schedule.window_groups(0), "hvd_dssync.torch.DistributedOptimizer")
        if not self._world_check_pending:
            self._check_ranks_agree()
            # The first window's process sets now, with the agreement: not in the first average's time.
            self._enter_window()
            self._warm_window_sets()
        _watch_until_exit(self)

    # --- what users see ---------------------------------------------------------------------

    @property
    def schedule(self):
        """The schedule: ``schedule.groups(step)`` is identical on every rank."""
        return self._plan.schedule

    @property
    def policy(self):
        return self._plan.policy

    def step(self, closure=None):
        if _called_by_horovod_to_create_state():
            # hvd.broadcast_optimizer_state fills empty state with a zero-gradient step on every
            # rank; it is no training step, so it neither averages nor advances the schedule.
            return super(self.__class__, self).step(closure)
        self._previous_tick, self._step_tick = self._step_tick, next(_step_ticks)
        return self._take_step(closure)

    def _take_step(self, closure=None, serving=False):
        """One step of the plan. ``serving``: this rank has run out of data (``hvd.join()``): it takes part in
        the step's communication with its model as it is, and updates nothing."""
        self._settle_step()
        if self._should_synchronize and self._synchronized and not serving:
            warnings.warn(SYNCHRONIZE_WARNING)
        early = None if self._plan.adaptive is None else self._check_early()
        action = self._plan.action(self.sync_step)
        self._drift = float("nan")
        if self._sparse_tables is None and self._sparse_average and action.kind != BSP:
            self._agree_on_sparse_tables()
        loss = None
        with self._amp_scaling() as (grad_scale, found_inf):
            if action.kind == BSP:
                if serving:  # as under Horovod's join, a joined rank's gradients count as zeros
                    for _, p in self._named_parameters:
                        p.grad = None
                    self._synchronized = False
                if self._should_synchronize or serving:
                    self.synchronize()
                if found_inf is not None:
                    # The gradients are the same on every rank now, so the skip is too (Horovod's behaviour),
                    # whether or not GradScaler looked before or after they were averaged.
                    found_inf = self._gradients_overflow()
                if not serving:
                    loss = self._local_update(closure, grad_scale, found_inf)
                    self._note_changed_rows()
                self._record(action, 0.0, 0)
            else:
                if not serving:
                    loss = self._local_update(closure, grad_scale, found_inf)
                    self._note_changed_rows()
                self._average_model(action)
        if serving:
            self.finish_pending()  # what the average carried must be known at the end of the step
        if self._plan.adaptive is not None:
            self._adapt(action, early)
        self._synchronized = False
        self.sync_step += 1
        return loss

    def _check_joinable(self):
        if self._plan.adaptive is not None:
            raise RuntimeError("hvd_dssync: hvd.join() is not supported with policy='adaptive': its future steps "
                               "depend on figures not measured yet, so the ranks could not agree when to leave.")
        if self._in_process_set():
            raise RuntimeError("hvd_dssync: hvd.join() joins the whole job, but this optimizer trains inside a "
                               "process set; make every rank take the same number of steps instead.")

    def _serve(self):
        """One step with this rank's model as it is (it has joined); ``True`` once every rank has left."""
        self._take_step(serving=True)
        leave = self._joins.leave_step(self._plan.partition)
        return leave is not None and self.sync_step > leave

    def synchronize(self):
        """Average the gradients over all ranks now, during a bulk-synchronous warm-up step.

        As with Horovod: call it before clipping gradients, then ``step()`` inside
        ``skip_synchronize()``. Outside the warm-up, gradients stay local and this does nothing.
        """
        self._settle_step()
        if not self._synchronized and self._plan.policy.action(self.sync_step) == BSP:
            self._average_gradients()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip the warm-up's gradient allreduce after an explicit ``synchronize()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes):
        """As Horovod's: ``passes`` backward passes accumulate their gradients between two steps."""
        check_horovod_arguments(hvd, self.op, self.gradient_predivide_factor, passes, self.process_set)
        self.backward_passes_per_step = passes

    def finish_pending(self):
        """Fold in an averaging still in flight (``overlap=True``); a collective on every rank."""
        if self._pending is None:
            return
        if self._world_changed():
            # Horovod was re-initialized (elastic reset): the averaging died with the old world, and
            # the model keeps this rank's own update.
            self._pending = None
            return
        handle, tensors, sent, received, signature, action, step, process_set, started, nbytes = self._pending
        self._pending = None
        with self._bounded(action, step):
            collectives.wait(handle)
        self._check_steps(signature * len(action.group), action, process_set, step)
        with torch.no_grad():
            for tensor, before, averaged in zip(tensors, sent, received):
                tensor.add_(averaged - before)
        self._outer_step()
        self._record(action, time.perf_counter() - started, nbytes)

    def state_dict(self):
        self.finish_pending()
        state = super(self.__class__, self).state_dict()
        state["dssync"] = {"sync_step": self.sync_step, "config": self._plan.config(),
                           "arguments": _portable(self._plan_arguments)}
        if self._plan.adaptive is not None:
            state["dssync"]["adaptive"] = self._plan.adaptive.state()
        if self._sparse_average:
            # None: no sets yet, every rank's model is the same; else this rank's rows that may differ.
            state["dssync"]["sparse_rows"] = None if self._row_sets is None else \
                {name: torch.from_numpy(rows) for name, rows in self._row_sets.state_dict().items()}
        if self._outer is not None:
            state["dssync"]["outer"] = {"anchors": [a.clone() for a in self._outer[0]],
                                        "momentum": [m.clone() for m in self._outer[1]]}
        return state

    def load_state_dict(self, state_dict):
        """Load a state saved by ``state_dict()``, DS-Sync's step included.

        A state saved in a world of the same size must have the same schedule configuration; one saved
        in a world of another size (elastic Horovod, or a job restarted on more or fewer ranks) must have
        been built with the same arguments, and the schedule is that of the current world. Loaded on
        rank 0 alone before the first step (Horovod's recipe), the step reaches the other ranks at that
        first step.
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop("dssync", None)
        if saved is not None:
            same_world = saved["config"]["schedule"].get("world_size") == self._plan.world_size
            if same_world and saved["config"] != self._plan.config():
                raise ValueError(f"the checkpoint's DS-Sync configuration {saved['config']} differs from "
                                 f"this optimizer's {self._plan.config()}; resume with the same arguments.")
            mine = _portable(self._plan_arguments)
            if not same_world and saved.get("arguments") != mine:
                raise ValueError(f"the checkpoint's DS-Sync arguments {saved.get('arguments')} differ from "
                                 f"this optimizer's {mine}; resume with the same arguments.")
            self.finish_pending()
            self.sync_step = int(saved["sync_step"])
            if self._plan.adaptive is not None and "adaptive" in saved:
                self._plan.adaptive.load(saved["adaptive"])
            outer = saved.get("outer")
            self._outer = None if outer is None else (list(outer["anchors"]), list(outer["momentum"]))
            # A checkpoint without sets (sparse averaging off when it was saved): every row may differ.
            rows = saved.get("sparse_rows", {})
            self._loaded_rows = None if rows is None else {k: torch.as_tensor(v).numpy() for k, v in rows.items()}
            if self._sparse_tables is not None:
                self._start_row_sets()
        self._synchronized = False
        super(self.__class__, self).load_state_dict(state_dict)

    # --- the mechanics ----------------------------------------------------------------------

    def _settle_step(self):
        """Join a new world, or take rank 0's step at the first step after construction (a collective).

        Horovod's resume recipe loads a checkpoint on rank 0 alone, then broadcasts the optimizer state,
        which carries no plain attribute such as the step (and nothing at all for a stateless optimizer),
        nor the adaptive policy's decision in force (broadcast here too, once).
        The first step after construction is the one point where every rank is sure to be, so every
        rank takes rank 0's step there (inside a process set, that of the set's first rank).
        """
        if self._world_check_pending or self._world_changed():
            self._join_world()
        elif not self._step_settled:
            self._take_state(self._scope.to_global((0,))[0], with_step=True)
        self._step_settled = True

    def _take_state(self, root, with_step):
        """``root``'s step (``with_step``) and adaptive policy state: the decision in force and the schedule's
        step (a collective: one broadcast of a few float64 numbers; ``broadcast_object`` took 0.19 s)."""
        adaptive = self._plan.adaptive
        mine = ([float(self.sync_step)] if with_step else []) + ([] if adaptive is None else adaptive.vector().tolist())
        if not mine:
            return
        got = collectives.broadcast(torch.tensor(mine, dtype=torch.float64), root, name=f"{self._name}.step",
                                    process_set=self.process_set).numpy()
        if with_step:
            self.sync_step, got = int(got[0]), got[1:]
        if adaptive is not None:
            adaptive.load_vector(got)

    def _world_changed(self):
        """Whether Horovod was re-initialized since this optimizer last looked; no communication.

        The registry notices a new rank or world size, or sets gone from Horovod's table, and counts it
        in its generation.
        """
        try:
            generation = self._registry.refresh()
        except ValueError:  # Horovod's "not initialized": its process-set table is gone
            raise RuntimeError("hvd_dssync: Horovod is shut down, so this step cannot average: another rank "
                               "failed or exited early (its output says why), or hvd.shutdown() was called."
                               ) from None
        return generation != self._generation

    def _join_world(self):
        """Take up the current world: every rank of it calls this at the same step (a collective).

        The schedule is rebuilt for the new world size, the agreement check runs again, and every rank
        continues from rank 0's step: the rank whose model and optimizer state ``hvd.elastic.TorchState``
        broadcast to the newcomers.
        """
        self._pending = None
        self._reference = None
        # Elastic Horovod has just broadcast rank 0's model to every rank: no row differs, and the
        # newcomers agree on the sparse tables with the others at the next averaging step.
        self._sparse_tables = self._row_sets = self._loaded_rows = None
        self._generation = self._registry.refresh()
        self._world_check_pending = False
        arguments = arguments_for_world(self._plan_arguments, hvd.size())
        self._scope = scope_of(hvd, hvd.global_process_set)  # elastic jobs train in the whole job
        self._joins = JoinState(self._scope.world_size)
        adaptive = self._plan.adaptive
        self._plan = _make_plan(arguments, self._scope)
        if adaptive is not None:
            self._plan.adaptive.load(adaptive.state())
        self.sync_step = self._check_ranks_agree(with_step=True)
        self._take_state(0, with_step=False)  # a newcomer's decision is rank 0's, as its step

    @contextlib.contextmanager
    def _amp_scaling(self):
        """GradScaler's ``grad_scale`` and ``found_inf`` for this step, hidden from the wrapped step meanwhile.

        GradScaler sets them before calling step() and deletes them after; plain torch optimizers assert
        that they are None, so _local_update applies them instead.
        """
        hidden = {key: self.__dict__.pop(key) for key in ("grad_scale", "found_inf") if key in self.__dict__}
        try:
            yield hidden.get("grad_scale"), hidden.get("found_inf")
        finally:
            self.__dict__.update(hidden)

    def _local_update(self, closure, grad_scale, found_inf):
        """The wrapped optimizer's step on this rank's gradient, unless GradScaler found inf or NaN in it."""
        if found_inf is not None and bool(found_inf):
            return None
        if grad_scale is not None:  # scaler.step() without scaler.unscale_() first
            inv_scale = grad_scale.double().reciprocal().float()
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv_scale.to(p.grad.device))
        return super(self.__class__, self).step(closure)

    def _gradients_overflow(self):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return any(not torch.isfinite(g.coalesce().values() if g.is_sparse else g).all() for g in grads)

    def _averaged_tensors(self):
        """``(name, tensor)`` of what a step averages, looked up now: the parameters the optimizer trains and
        the model's floating-point buffers.

        Frozen parameters and those the optimizer does not train never change locally. Buffers are looked
        up at each step because ``model.to()``, ``.half()`` or SyncBatchNorm conversion replace them.
        """
        trained = {id(p) for group in self.param_groups for p in group["params"] if p.requires_grad}
        tensors = [(name, p) for name, p in self._named_parameters if id(p) in trained]
        if self._model is not None and self._average_buffers:
            tensors += [(f"buffer.{name}", b) for name, b in self._model.named_buffers() if b.is_floating_point()]
        return tensors

    def _enter_window(self):
        """Register the process sets of the schedule's window at this step and release the last window's, when
        the step enters a new window (collectives: every rank at the same step)."""
        change = self._plan.window_change(self.sync_step)
        if change is not None and not self._in_process_set():
            acquire, release = change
            self._registry.acquire(acquire)
            self._registry.release(release)

    def _warm_window_sets(self):
        """One tiny allreduce on each process set this rank belongs to among the first window's groups and
        the later windows' groups already registered (statically, by :func:`init`), so that Horovod's
        one-off set-up of a set's first collective (about 0.2 s on the bench's testbed) is taken here and not
        by the first average in it. Only where every rank belongs to as many of the sets: every Horovod op
        advances the counter that names a script's unnamed ops."""
        if self._in_process_set():
            return
        schedule, size = self._plan.schedule, self._scope.world_size
        groups = sorted(set(schedule.window_groups(0)) | set(schedule.every_group() or ()))
        sets = self._registry.registered(self._scope.to_global(g) for g in groups if 1 < len(g) < size)
        groups = [g for g in groups if self._scope.to_global(g) in sets]
        counts = {sum(position in g for g in groups) for position in range(size)}
        if not groups or len(counts) != 1:
            return
        handles = [hvd.allreduce_async_(torch.zeros(1), name=f"{self._name}.warm.{k}", op=hvd.Sum,
                                        process_set=sets[self._scope.to_global(g)])
                   for k, g in enumerate(groups) if self._scope.rank in g]
        for handle in handles:
            collectives.wait(handle)

    def _average_model(self, action):
        self.finish_pending()
        if action.kind == LOCAL:  # every rank takes its local steps together: no op on any rank
            self._record(action, 0.0, 0)
            return
        self._enter_window()
        if self._compression is not hvd.Compression.none and self._reference is None:
            self._establish_reference(action)
            return
        process_set = self._process_set_of(action)
        if process_set is None:
            self._record(action, 0.0, 0)
            return
        if len(action.group) == 1:
            # Nobody to average with, so the model stays put; tiny ops on this rank's own set all the same,
            # as many as a group's members issue (sparse averaging gathers the row sets first), since Horovod
            # names a user's unnamed ops by counting every op of the process: every rank must issue as many
            # ops as the others.
            for k in range(1 if self._row_sets is None else 2):
                collectives.allreduce_(torch.zeros(1), name=f"{self._name}.alone.{k}", op=hvd.Sum,
                                       process_set=process_set)
            self._record(action, 0.0, 0)
            return
        named = [(n, t.data) for n, t in self._averaged_tensors()]
        name = f"{self._name}.{action.kind}.{process_set.process_set_id}"
        writes, gathered_bytes = [], 0
        if self._row_sets is not None:
            with self._bounded(action, self.sync_step):
                named, writes, gathered_bytes = self._rows_to_average(named, action, process_set, name)
        tensors = [t for _, t in named]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sent_bytes = ring_allreduce_bytes(len(action.group), nbytes) + gathered_bytes
        # Rides along, uncompressed, so that the members find out if they are at different steps.
        signature = self._signature(tensors)
        started = time.perf_counter()
        if self._overlap:
            sent = [t.detach().clone() for t in tensors]
            received = [t.clone() for t in sent]
            handle = hvd.grouped_allreduce_async_(received + [signature], name=name, op=hvd.Average,
                                                  process_set=process_set)
            self._pending = (handle, tensors, sent, received, signature, action, self.sync_step, process_set,
                             started, sent_bytes)
            return
        with self._bounded(action, self.sync_step):
            if self._compression is hvd.Compression.none and self._plan.adaptive is not None:
                signature = self._average_adapting(tensors, signature, name, process_set, action)
            elif self._compression is hvd.Compression.none:
                collectives.grouped_allreduce_(tensors + [signature], name=name, op=hvd.Average,
                                               process_set=process_set)
            else:
                sent_bytes, signature = self._average_differences(tensors, action, process_set, name, signature)
        self._check_steps(signature * len(action.group), action, process_set, self.sync_step)
        with torch.no_grad():
            for table, index, rows in writes:
                table.index_copy_(0, index, rows)
        if self._row_sets is not None and action.kind == GLOBAL:
            self._row_sets.clear()
        self._outer_step()
        self._record(action, time.perf_counter() - started, sent_bytes,
                     sparse_rows=sum(len(index) for _, index, _ in writes))

    # --- sparse averaging of embedding tables (hvd_dssync.sparse) -----------------------------

    def _agree_on_sparse_tables(self):
        """Agree with every rank of the scope on the tables averaged sparsely (one small allreduce, once).

        A table qualifies if some rank saw a sparse gradient for it and no rank's optimizer can change rows
        outside what :meth:`_changed_rows` reports. Ranks whose table got no gradient this step still
        agree, since the flags are reduced with max.
        """
        params = [p for _, p in self._named_parameters]
        seen = [float(p.grad is not None and p.grad.is_sparse) for p in params]
        unsupported = [float(s and self._changed_rows(p) is None) for s, p in zip(seen, params)]
        flags = hvd.allreduce(torch.tensor(seen + unsupported), name=f"{self._name}.sparse", op=hvd.Max,
                              process_set=self.process_set)
        n = len(params)
        self._sparse_tables = {name: p for k, (name, p) in enumerate(self._named_parameters)
                               if flags[k] and not flags[n + k]}
        skipped = [name for k, (name, _) in enumerate(self._named_parameters) if flags[k] and flags[n + k]]
        if skipped:
            warnings.warn(f"hvd_dssync: {', '.join(skipped)} averaged densely: sparse averaging needs an optimizer "
                          "that changes only the rows it reports (SGD, SparseAdam, Adagrad), not "
                          f"{type(self).__name__} with these settings.")
        self._start_row_sets()

    def _start_row_sets(self):
        if not self._sparse_tables:
            self._row_sets = None
            return
        self._row_sets = RowSets({name: p.shape[0] for name, p in self._sparse_tables.items()})
        if self._loaded_rows is not None:
            self._row_sets.load_state_dict(self._loaded_rows)

    def _changed_rows(self, p):
        """Rows of table ``p`` that this step's update may have changed, or None if the optimizer can change
        others. Read after the step: SGD with momentum moves every row still in its (sparse) buffer."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if isinstance(self, torch.optim.SGD) and not group.get("weight_decay"):
            if not group.get("momentum"):
                return _gradient_rows(p)
            buffer = self.state.get(p, {}).get("momentum_buffer")
            if buffer is None:
                return _gradient_rows(p)
            return buffer.coalesce().indices()[0].numpy() if buffer.is_sparse else None
        if isinstance(self, (torch.optim.SparseAdam, torch.optim.Adagrad)) and not group.get("weight_decay"):
            return _gradient_rows(p)
        return None

    def _note_changed_rows(self):
        if self._row_sets is None:
            return
        for name, p in self._sparse_tables.items():
            rows = self._changed_rows(p)
            if rows is not None and len(rows):
                self._row_sets.touch(name, rows)

    def _rows_to_average(self, named, action, process_set, name):
        """Gather the group's row sets; put in place of each sparse table the rows of the union (or the whole
        table where that is cheaper). Returns the tensors to average, the ``(table, index, rows)`` to write back
        after the average, and the bytes the gathering sent. Every member adopts the union."""
        mine = torch.from_numpy(pack_rows(self._row_sets))
        gathered = collectives.allgather(mine, name=f"{name}.rows", process_set=process_set)
        gathered_bytes = allgather_bytes(len(action.group), gathered.numel() * gathered.element_size())
        unions = unpack_unions(gathered.numpy(), self._row_sets.tables)
        out, writes = [], []
        for tensor_name, tensor in named:
            union = unions.get(tensor_name)
            if union is None or average_densely(len(union), tensor.shape[0]):
                out.append((tensor_name, tensor))
            elif len(union):
                index = torch.from_numpy(union)
                rows = tensor.index_select(0, index)
                out.append((tensor_name, rows))
                writes.append((tensor, index, rows))
            # an empty union: the table is equal on every member, nothing to send
        for table, union in unions.items():
            self._row_sets.adopt(table, union)
        return out, writes, gathered_bytes

    # --- the adaptive policy ------------------------------------------------------------------

    def _average_adapting(self, tensors, signature, name, process_set, action):
        """The average, with what the adaptive policy needs riding along in the same collective: in a group
        average, each member's squared norm (one element), so that the members learn how far apart their
        models were (:func:`drift_of`; the policy uses it under group averaging only, so global averages
        skip the norms, 7 ms a step on the bench); at a decision step under global averaging, every rank's
        figures (:func:`encode_figures`), and at a global average inside a window, the last period's ones
        (unless the ranks exchanged them before it: :meth:`_check_early`)."""
        adaptive, size = self._plan.adaptive, self._scope.world_size
        measuring, figures = action.kind == GROUP, adaptive.carried_figures(self.sync_step)
        extra = [_square_norm(tensors)] if measuring else []
        if figures is not None:
            extra += encode_figures(figures, self._scope.rank, size).tolist()
        if not extra:
            collectives.grouped_allreduce_(tensors + [signature], name=name, op=hvd.Average, process_set=process_set)
            return signature
        carried = torch.cat([signature, torch.tensor(extra, dtype=signature.dtype)])
        collectives.grouped_allreduce_(tensors + [carried], name=name, op=hvd.Average, process_set=process_set)
        at = len(signature)
        if measuring:
            self._drift = drift_of(float(carried[at]), _square_norm(tensors))
        if figures is not None:
            self._gathered_figures = decode_figures(carried[at + measuring:].double().numpy(), size, averaged=True)
        return carried[:at]

    def _adapt(self, action, early=None):
        """Note this step's figures; at a decision step, decide from every rank's figures (which rode along
        in the step's global average, or else one small allgather after it: a probe, whose average's time
        they count, or the first window's end). ``early``: the decision this step's early check took."""
        adaptive, now = self._plan.adaptive, time.perf_counter()
        this_step = self.last_sync is not None and self.last_sync["step"] == self.sync_step
        seconds = self.last_sync["seconds"] if this_step and self.last_sync["kind"] == action.kind else math.nan
        compute = math.nan if self._step_ended is None else now - self._step_ended - (seconds if seconds > 0 else 0.0)
        gathered, self._gathered_figures = self._gathered_figures, None
        decision = adaptive.end_step(self.sync_step, action.kind, seconds, compute, self._drift, gathered=gathered,
                                     gather=functools.partial(self._gather_figures, action))
        decision = decision or early
        if decision is not None:
            self.last_sync = dict(self.last_sync or {"step": self.sync_step, "kind": action.kind},
                                  decision=decision.as_dict())
        self._step_ended = time.perf_counter()

    def _check_early(self):
        """With ``switch_early="exchange"``, before a global average inside a window (an early check):
        exchange the last period's figures (one small allreduce, bounded by the watchdog) and let the
        adaptive policy make this very step a group average (``check_early``); returns its decision, or
        ``None``. Every rank reads the same sum."""
        adaptive, size = self._plan.adaptive, self._scope.world_size
        figures = adaptive.early_figures(self.sync_step)
        if figures is None:
            return None
        with self._bounded(Action(GLOBAL, tuple(range(size))), self.sync_step):
            summed = torch.from_numpy(encode_figures(figures, self._scope.rank, size))
            collectives.allreduce_(summed, name=f"{self._name}.adaptive.early", op=hvd.Sum,
                                   process_set=self.process_set)
        return adaptive.check_early(self.sync_step, decode_figures(summed.numpy(), size))

    def _gather_figures(self, action, figures):
        """Every rank's adaptive figures, gathered after the step's average (a probe's, or one that could not
        carry them: compression, overlap, a world of one), bounded by the watchdog."""
        everyone = action._replace(kind=GLOBAL, group=tuple(range(self._scope.world_size)))
        with self._bounded(everyone, self.sync_step):
            return collectives.allgather(torch.from_numpy(figures), name=f"{self._name}.adaptive",
                                         process_set=self.process_set).numpy()

    # --- inside a process set, and lossy compression -----------------------------------------

    def _in_process_set(self):
        return self.process_set is not hvd.global_process_set

    def _process_set_of(self, action):
        """The Horovod process set of ``action``'s group (positions in the scope); ``None``: nothing to average."""
        if action.kind == GLOBAL or len(action.group) == self._scope.world_size:
            return self.process_set
        if self._in_process_set() and len(action.group) == 1:
            return None  # a group of one keeps its model; no set was registered for it
        return self._registry.get(self._scope.to_global(action.group))

    def _establish_reference(self, action):
        """The first averaging step under lossy compression: an exact average over the scope sets the reference.

        Every rank of the scope reaches its first averaging step at the same step, whatever its group.
        """
        tensors = [t.data for _, t in self._averaged_tensors()]
        started = time.perf_counter()
        everyone = action._replace(kind=GLOBAL, group=tuple(range(self._scope.world_size)))
        signature = self._signature(tensors)
        with self._bounded(everyone, self.sync_step):
            collectives.grouped_allreduce_(tensors + [signature],
                                           name=f"{self._name}.reference.{self.process_set.process_set_id}",
                                           op=hvd.Average, process_set=self.process_set)
        self._check_steps(signature * self._scope.world_size, everyone, self.process_set, self.sync_step)
        self._reference = [t.detach().clone() for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._record(everyone, time.perf_counter() - started, ring_allreduce_bytes(self._scope.world_size, nbytes))

    def _average_differences(self, tensors, action, process_set, name, signature):
        """Average the group's models through their compressed differences from the shared reference.

        Rank ``j`` sends ``C(x_j - r)`` and keeps ``x_j <- r + mean_k C(x_k - r) + (x_j - r - C(x_j - r))``:
        the group's mean is kept exactly (up to the collective's own arithmetic on the compressed
        differences), and each rank stays within its own compression error of it, so an update smaller
        than the compression's resolution is carried, never rounded away. ``r`` must be the same on every
        member: set by an exact average over the scope, moved by global averages only. The step signature
        rides along uncompressed. Returns the bytes sent and the averaged signature.
        """
        compression = self._compression
        differences = [t - r for t, r in zip(tensors, self._reference)]
        compressed, contexts = zip(*(compression.compress(d) for d in differences))
        *averaged, signature = collectives.grouped_allreduce(list(compressed) + [signature], name=name,
                                                             op=hvd.Average, process_set=process_set)
        for t, r, d, c, a, ctx in zip(tensors, self._reference, differences, compressed, averaged, contexts):
            received = compression.decompress(a, ctx)
            t.copy_(r + received + (d - compression.decompress(c, ctx)))
            if action.kind == GLOBAL:
                r.add_(received)
        nbytes = sum(c.numel() * c.element_size() for c in compressed)
        return ring_allreduce_bytes(len(action.group), nbytes), signature

    def _outer_step(self):
        """With ``outer_momentum`` > 0: momentum on the change of the averaged model since the last average.

        SlowMo / DiLoCo's outer step, with an outer learning rate of 1: ``m <- beta m + (x - anchor)``, then
        ``x <- anchor + m`` and ``anchor <- x``, where ``x`` is this rank's parameters just averaged and
        ``anchor`` their value after the previous outer step (the first average only sets it). ``beta = 0``
        is plain averaging. Buffers (BatchNorm statistics) are left as averaged. No communication.
        """
        if not self._outer_momentum:
            return
        params = [t.data for name, t in self._averaged_tensors() if not name.startswith("buffer.")]
        with torch.no_grad():
            if self._outer is None:
                self._outer = ([p.detach().clone() for p in params], [torch.zeros_like(p) for p in params])
                return
            for p, anchor, momentum in zip(params, *self._outer):
                momentum.mul_(self._outer_momentum).add_(p - anchor)
                p.copy_(anchor + momentum)
                anchor.copy_(p)

    def _average_gradients(self):
        params = [p for _, p in self._named_parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                # Every rank must reduce the same tensors; a parameter unused here contributes zeros.
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse and not self.sparse_as_dense:
                raise ValueError("sparse gradients need sparse_as_dense=True during hvd_dssync's warm-up")
        sparse_dims = [p.grad.sparse_dim() if p.grad.is_sparse else None for p in params]
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
        prescale, postscale = 1.0, 1.0
        if self.op == hvd.Average and self.gradient_predivide_factor != 1.0:
            prescale = 1.0 / self.gradient_predivide_factor
            postscale = self.gradient_predivide_factor
        compressed = [self._compression.compress(g) for g in grads]
        action = self._plan.action(self.sync_step)
        signature = self._signature(grads)
        with self._bounded(action, self.sync_step):
            *reduced, signature = collectives.grouped_allreduce([c for c, _ in compressed] + [signature],
                                                                name=f"{self._name}.bsp", op=self.op,
                                                                prescale_factor=prescale, postscale_factor=postscale,
                                                                process_set=self.process_set)
        self._check_steps(signature * (self._scope.world_size if self.op == hvd.Average else 1), action,
                          self.process_set, self.sync_step)
        for p, g, r, (_, ctx), sparse_dim in zip(params, grads, reduced, compressed, sparse_dims):
            g.copy_(self._compression.decompress(r, ctx))
            if sparse_dim is not None:
                # The layout the optimizer saw before (an embedding's rows), or its sparse momentum buffer
                # could not add the gradients of later steps.
                p.grad = g.to_sparse(sparse_dim)

    def _signature(self, tensors):
        """What rides along with an average: the step's signature, then what this rank knows of ranks that
        ran out of data (:mod:`hvd_dssync.join`). In float32 when the tensors are float32: Horovod fuses a
        grouped allreduce by dtype, so another dtype would cost a second collective every step."""
        dtype = torch.float32 if tensors and tensors[0].dtype == torch.float32 else torch.float64
        return torch.from_numpy(np.concatenate([step_signature(self.sync_step), self._joins.payload()])).to(dtype)

    def _check_steps(self, sums, action, process_set, step):
        """Take in what rode along with an average (see ``_signature``): the joins the members knew of, and a
        check that they were at the same step, which raises on every member if not.

        ``sums`` are the members' signatures summed; only when the steps differ does a second collective
        (among the members, who all found out together) gather who was at which step, for the error.
        """
        sums = sums.double().numpy()
        self._joins.merge(sums[SIGNATURE_LENGTH:] / len(action.group))
        if not steps_differ(sums[:SIGNATURE_LENGTH], len(action.group)):
            return
        with self._bounded(action, step):
            gathered = hvd.allgather(torch.tensor([[hvd.rank(), step]]), name=f"{self._name}.drift",
                                     process_set=process_set)
        raise RuntimeError(describe_step_drift({rank: s for rank, s in gathered.tolist()}))

    @contextlib.contextmanager
    def _bounded(self, action, step):
        """Bound the wait for ``action``'s group (see :mod:`hvd_dssync.watchdog`); name it if it expires."""
        what = describe_wait(hvd.rank(), self._scope.to_global(action.group), step, action.kind)
        try:
            with self._watchdog.watching(what):
                yield
        except Exception as e:  # Horovod's error after the watchdog shut it down: say why instead
            if self._watchdog.expired is None:
                raise
            self._watchdog.wait_for_shutdown()
            raise RuntimeError(self._watchdog.expired) from e

    def _record(self, action, seconds, nbytes, sparse_rows=0):
        self.last_sync = {"step": self.sync_step, "kind": action.kind, "group": self._scope.to_global(action.group),
                          "seconds": seconds, "bytes_sent": nbytes}
        if self._row_sets is not None:
            self.last_sync.update(sparse_rows=sparse_rows, row_set=self._row_sets.total())

    def _check_ranks_agree(self, with_step=False):
        """One allgather of the configuration: every rank raises the same error, naming what differs.

        With ``with_step``, the step is gathered along and rank 0's is returned.
        """
        shapes = [(name, tuple(t.shape), str(t.dtype)) for name, t in self._averaged_tensors()]
        options = {"overlap": self._overlap, "backward_passes_per_step": self.backward_passes_per_step,
                   "op": str(self.op), "op names": self._name, "outer_momentum": self._outer_momentum}
        mine = agreement_payload(agreement_fields(self._plan, shapes, options, step=self.sync_step))
        gathered = hvd.allgather(torch.from_numpy(mine), name="dssync.agreement", process_set=self.process_set)
        ranks = check_agreement(gathered.numpy(), what="hvd_dssync.torch.DistributedOptimizer")
        return ranks[0]["step"] if with_step else self.sync_step


def _square_norm(tensors):
    """The squared norm of all ``tensors`` together, accumulated in float64 without a float64 copy of
    them (12x faster than ``t.double().pow(2).sum()`` on the bench's 1.2 MB model: 0.17 ms against 2.1)."""
    return sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors)


def _gradient_rows(p):
    return p.grad.coalesce().indices()[0].numpy() if p.grad is not None and p.grad.is_sparse else None


def _make_plan(arguments, scope=None):
    """The plan of this rank: in the whole job, or at its position in ``scope`` (a process set)."""
    if scope is None:
        return SyncPlan(hvd.rank(), hvd.size(), **arguments)
    return SyncPlan(scope.rank, scope.world_size, **arguments)


def _portable(arguments):
    """The plan's arguments as plain data, for checkpoints (a schedule object by its configuration)."""
    out = dict(arguments)
    schedule, topology = out["schedule"], out["topology"]
    out["schedule"] = schedule if isinstance(schedule, str) else getattr(schedule, "config", lambda: repr(schedule))()
    out["topology"] = None if topology is None else getattr(topology, "to_dict", lambda: repr(topology))()
    return out


def _called_by_horovod_to_create_state():
    # Our step() is reached through torch's profiling wrapper, so look a few frames up.
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code is hvd_functions.broadcast_optimizer_state.__code__:
            return True
        frame = frame.f_back
    return False


def join(device=-1):
    """``hvd.join()`` for a job that trains with DS-Sync (uneven data): importing ``hvd_dssync.torch`` puts it
    in place of Horovod's, so the call in a script stays as it is.

    A rank with no more batches calls it. It then goes on taking part in its groups' averages with its model
    as it is, step by step, while the others train on; every rank returns after one and the same step,
    agreed without an extra collective (:mod:`hvd_dssync.join`). Returns the rank that joined last, as
    Horovod's does. Without a DS-Sync optimizer in training this is Horovod's own ``join``.

    The optimizers served are those stepped in the last training iteration, in the order they were stepped.
    Unlike Horovod's, a joined rank answers only DS-Sync's averages: a script's own collectives between
    steps (a metric's allreduce every batch) would wait for it, so average metrics after ``join()`` returns.

    Example::

        for batch in loader:            # some ranks have more batches than others
            ...
            opt.step()
        hvd.join()                      # every rank leaves at the same step
        dss.synchronize_models(model)
    """
    optimizers = _in_training()
    if not optimizers:
        return _horovod_join(device)
    for optimizer in optimizers:
        optimizer._check_joinable()
        optimizer._joins.note_joined(optimizer._scope.rank, optimizer.sync_step)
    serving = list(optimizers)
    while serving:
        serving = [optimizer for optimizer in serving if not optimizer._serve()]
    last = optimizers[0]._joins.last_to_join()
    for optimizer in optimizers:
        optimizer._joins.reset()
    return last


_horovod_join = hvd.join


def _in_training():
    """The DS-Sync optimizers stepped in the last training iteration (since the last-stepped one's step before
    that), in the order they were stepped."""
    stepped = sorted((o for o in _live_optimizers if o._step_tick is not None), key=lambda o: o._step_tick)
    if not stepped:  # a rank without a single batch: every optimizer it built, in the order it built them
        return sorted(_live_optimizers, key=lambda o: o._constructed)
    since = stepped[-1]._previous_tick
    return [o for o in stepped if since is None or o._step_tick > since]


def DistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         groups=None, sparse_as_dense=False, process_set=hvd.global_process_set, *,
                         num_groups=None, group_size=None, seed=0, schedule=None, topology="auto",
                         warmup_steps=0, global_every=0, average_every=1, model=None, average_buffers=True,
                         overlap=False, schedule_options=None, outer_momentum=0.0, policy=None,
                         sparse_average=True):
    """Wrap ``optimizer`` so that ranks average their models in shuffled groups (DS-Sync).

    Drop-in for ``hvd.DistributedOptimizer``: it takes the same arguments and returns an instance of
    ``optimizer``'s class. Each rank steps on its own gradient, then averages the model inside the group
    its schedule gives it for this step; the groups shuffle from step to step so that all models reach
    consensus. No gradient is allreduced outside the warm-up.

    Horovod's arguments keep their meaning where it applies: a lossy ``compression`` (``hvd.Compression.fp16``)
    compresses each rank's difference from a reference all ranks share, and each rank keeps its own
    compression error, so updates below the compression's resolution are not lost (the first averaging
    step is an exact average over the ranks that sets the reference; global averages move it; it costs one
    copy of the averaged tensors). ``process_set`` runs DS-Sync among that set's ranks only (build and step
    the optimizer on them alone, as with Horovod); its groups must be registered beforehand by every rank
    of the job, with :func:`init` (``process_sets=``) or :func:`add_process_set_groups`. ``op`` (Average or
    Sum), ``gradient_predivide_factor`` and ``sparse_as_dense`` apply to the warm-up's gradient allreduce;
    ``backward_passes_per_step`` gradients simply accumulate between steps; ``groups`` (Horovod's fusion
    grouping) is accepted and has nothing to act on, since the whole model is one grouped allreduce per
    step. ``op=hvd.Adasum`` is rejected. Horovod's deprecated ``num_groups`` (tensor fusion groups) is
    replaced by DS-Sync's ``num_groups``.

    Without DS-Sync arguments the schedule is chosen from the job: "topology" when the racks are known
    (``topology=`` or ``HVD_DSSYNC_TOPOLOGY``), else random groups ("shuffle") of
    :func:`hvd_dssync.plan.default_group_size` (pairs for 4 ranks, groups of 4 from 8 ranks on).

    Args (keyword-only, DS-Sync's own):
        num_groups: groups per step (schedule "shuffle"); or give ``group_size``; or neither (the default).
        group_size: the largest group size ("shuffle"), or the butterfly's group size.
        seed: integer seed shared by all ranks.
        schedule: "shuffle", "butterfly", "topology", a schedule object with ``groups(step)``, or None
            (the default: "topology" where the racks are known, else "shuffle").
        topology: racks for schedule "topology" (a Topology, a JSON file, or lists of ranks); "auto" (the
            default) senses them once per job where no other DS-Sync argument names the schedule
            (:mod:`hvd_dssync.sensing`): the hosts' layout, else timed host pairs; two racks or more make
            the default schedule "topology" on them. ``opt.sensed`` says how, what and in how many seconds.
        warmup_steps: bulk-synchronous steps first (gradient allreduce over all ranks).
        global_every: average over all ranks every this many steps (0: never).
        average_every: average every this many steps; the steps between are local, without communication
            (local SGD; with ``num_groups=1`` this is PyTorch's post-local SGD with period
            ``average_every``). ``global_every`` counts steps too, and the schedule advances once per
            group average.
        model: the module; its floating-point buffers (BatchNorm statistics) are averaged too.
        average_buffers: set False to keep buffers local.
        overlap: start the averaging asynchronously and fold it in at the next step (one step stale).
        schedule_options: extra arguments for the named schedule (e.g. ``window_steps``).
        outer_momentum: momentum of an outer step after each average (SlowMo / DiLoCo style, outer learning
            rate 1): the parameters move by ``m <- outer_momentum * m + change of the averaged model since
            the last average``; 0 (the default) is plain averaging. Costs two copies of the parameters.
        policy: None or "fixed" (the periods above), or "adaptive" (or an
            :class:`hvd_dssync.adaptive.AdaptivePolicy`): the ranks measure what their averages cost and
            choose together, every ``decide_every`` steps, between global and group averages and the period
            (from ``average_every`` up); ``global_every`` must be 0. Each decision is in
            ``last_sync["decision"]`` at the step that took it, and in the checkpoint.
        sparse_average: average embedding tables whose gradients are sparse (``nn.Embedding(...,
            sparse=True)``, ``nn.EmbeddingBag``) over only the rows that can differ between the members
            (:mod:`hvd_dssync.sparse`): the same result as a dense average, at a cost proportional to the
            rows in play. ``last_sync["sparse_rows"]`` counts the rows averaged so, ``last_sync["row_set"]``
            this rank's rows in play. Needs an optimizer that changes only the rows it reports (SGD,
            SparseAdam, Adagrad); off with ``overlap=True`` or a lossy ``compression``. False: dense.

    Example::

        import horovod.torch as hvd
        import hvd_dssync.torch as dss

        hvd.init()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model,
                                       num_groups=2, seed=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    scope = check_horovod_arguments(hvd, op, gradient_predivide_factor, backward_passes_per_step, process_set)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Arg ``optimizer`` must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
            or not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"Arg ``outer_momentum`` must be a number in [0, 1), got {outer_momentum!r}.")
    if overlap and compression is not hvd.Compression.none:
        raise ValueError("Arg ``compression`` is not supported with overlap=True.")
    named_parameters = _check_named_parameters(optimizer, named_parameters)
    adaptive = AdaptivePolicy.resolve(policy, average_every, global_every)
    # topology="auto": the racks sensed once per job (hvd_dssync.sensing), or None where there is one rack.
    from .functions import _default_topology
    topology, sensed = _default_topology(schedule, num_groups, group_size, topology, schedule_options,
                                         scope.world_size == hvd.size())
    schedule, num_groups, group_size = resolve_schedule(schedule, num_groups, group_size, topology)
    in_process_set = scope.world_size != hvd.size()
    if in_process_set and (topology is not None or schedule == "topology"):
        raise ValueError("Arg ``process_set``: schedule='topology' and ``topology`` are not supported inside a "
                         "process set (finding the hosts is a collective over all ranks); use 'shuffle' or "
                         "'butterfly'.")
    if topology is not None or schedule == "topology":
        from .functions import job_topology
        topology = job_topology(topology)
    plan_arguments = dict(schedule=schedule, num_groups=num_groups, group_size=group_size, seed=seed,
                          topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                          average_every=average_every, schedule_options=schedule_options)
    if adaptive is not None:
        plan_arguments["adaptive"] = adaptive.config()
    # A rank outside the set validates as its ranks do (at the set's first position), then trains alone.
    plan = _make_plan(plan_arguments, scope._replace(rank=0) if scope.outside else scope)
    if in_process_set and plan.schedule.window_steps is not None:
        raise ValueError(f"Arg ``process_set``: the schedule {plan.schedule!r} changes its groups every "
                         f"{plan.schedule.window_steps} steps, but inside a process set the groups are registered "
                         "once, by every rank of the job; use one endless window (window_steps=None).")
    check_nccl_process_sets(plan.schedule.window_steps, hvd.nccl_built(),
                            on_gpu=any(p.is_cuda for _, p in named_parameters),
                            gpu_operations=os.environ.get("HOROVOD_GPU_ALLREDUCE") or
                            os.environ.get("HOROVOD_GPU_OPERATIONS"))
    if hvd.size() == 1 and overlap:
        warnings.warn("overlap=True does nothing with one rank.")
    if scope.outside:
        acquire_registered(hvd, scope, plan.schedule.window_groups(0), "hvd_dssync.torch.DistributedOptimizer",
                           take=False)
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(OutsideProcessSet.__dict__))
        return cls(optimizer.param_groups, process_set, backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DSSyncOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, sparse_as_dense,
                  process_set if in_process_set else hvd.global_process_set, plan, plan_arguments, model,
                  average_buffers, overlap, scope, float(outer_momentum), bool(sparse_average))
    wrapped.sensed = None if sensed is None else sensed.to_dict()  # what topology="auto" found, and its cost
    return wrapped
