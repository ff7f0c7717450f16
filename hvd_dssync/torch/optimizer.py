"""DS-Sync ``DistributedOptimizer`` for PyTorch: Horovod's signature, DS-Sync's step.

One training step, in order: the wrapped optimizer steps on this rank's own gradient; the model
(parameters and floating-point buffers) is averaged inside this step's group with one grouped allreduce
on the group's Horovod process set; the step is counted. During a bulk-synchronous warm-up the step is
Horovod's instead: gradients are averaged over all ranks first, and no model averaging follows.

Elastic Horovod: when ``hvd.elastic.run`` re-initializes Horovod for a new world, the next ``step()``
notices it (this rank, the world size or the registered process sets changed), rebuilds the schedule for
the new world, checks again that all ranks agree, and continues from rank 0's step.
"""
import atexit
import contextlib
import os
import sys
import time
import warnings
import weakref

import horovod.torch as hvd
import torch
from horovod.torch import functions as hvd_functions

from ..plan import (BSP, GLOBAL, LOCAL, SyncPlan, agreement_fields, agreement_payload, arguments_for_world,
                    check_agreement, check_horovod_arguments, resolve_schedule, ring_allreduce_bytes)
from ..process_sets import elastic_job, registry_for
from ..topology import loopback_hostname_warning
from ..watchdog import describe_wait, process_watchdog

__all__ = ["DistributedOptimizer"]

# Optimizers with an averaging in flight (overlap=True): synchronize_models() completes them first.
_live_optimizers = weakref.WeakSet()
_exit = {"drain_registered": False, "uncaught_exception": False}
EXIT_TIMEOUT_ENV = "HVD_DSSYNC_EXIT_TIMEOUT"


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
    previous_hook = sys.excepthook

    def note_uncaught(*exc_info):
        _exit["uncaught_exception"] = True
        previous_hook(*exc_info)

    sys.excepthook = note_uncaught
    atexit.register(_drain_before_shutdown)


def _drain_before_shutdown():
    """Let every rank finish its last group average before any rank shuts Horovod down.

    Under DS-Sync the groups of the last step finish at different times; a rank that exits and shuts
    Horovod down while another group still averages makes that group's op fail. So a script that ends
    without a global collective gets one here: a named allreduce, waited for at most
    ``HVD_DSSYNC_EXIT_TIMEOUT`` seconds (default 30) so that a rank whose peers are stuck or gone still
    exits. Skipped after an uncaught exception, when Horovod's shutdown should reach the others at once.
    """
    if _exit["uncaught_exception"] or not hvd.is_initialized():
        return
    try:
        for optimizer in list(_live_optimizers):
            optimizer.finish_pending()
        handle = hvd.allreduce_async(torch.zeros(1), name="dssync.exit", op=hvd.Sum)
        deadline = time.monotonic() + float(os.environ.get(EXIT_TIMEOUT_ENV, "30"))
        while not hvd.poll(handle) and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # Horovod already shut down by a failing peer: nothing left to drain
        pass


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

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, plan, plan_arguments, model,
                 average_buffers, overlap):
        super(self.__class__, self).__init__(params)
        self._named_parameters = named_parameters
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._op = op
        self._gradient_predivide_factor = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._plan_arguments = plan_arguments
        self._plan = plan
        self._overlap = overlap
        self._registry = registry_for(hvd)
        self._generation = self._registry.refresh()
        self._synchronized = False
        self._skip_synchronize = False
        self._pending = None
        self.sync_step = 0
        self.last_sync = None
        buffers = [] if model is None or not average_buffers else [
            (f"buffer.{name}", b) for name, b in model.named_buffers() if b.is_floating_point()]
        self._averaged = [(name, p) for name, p in named_parameters] + buffers
        # Under elastic Horovod a worker that joins builds its optimizer while the others are inside
        # hvd.elastic.run's state sync, so no collective may run here; the first step checks instead.
        self._world_check_pending = elastic_job()
        self._watchdog = process_watchdog(hvd.shutdown)
        if not self._world_check_pending:
            self._check_ranks_agree()
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
        if self._world_check_pending or self._world_changed():
            self._join_world()
        action = self._plan.action(self.sync_step)
        if action.kind == BSP:
            if not self._skip_synchronize:
                self.synchronize()
            loss = super(self.__class__, self).step(closure)
            self._synchronized = False
            self._record(action, 0.0, 0)
        else:
            loss = super(self.__class__, self).step(closure)
            self._average_model(action)
        self.sync_step += 1
        return loss

    def synchronize(self):
        """Average the gradients over all ranks now, during a bulk-synchronous warm-up step.

        As with Horovod: call it before clipping gradients, then ``step()`` inside
        ``skip_synchronize()``. Outside the warm-up, gradients stay local and this does nothing.
        """
        if self._plan.policy.action(self.sync_step) != BSP or self._synchronized:
            return
        params = [p for _, p in self._named_parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                # Every rank must reduce the same tensors; a parameter unused here contributes zeros.
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse and not self._sparse_as_dense:
                raise ValueError("sparse gradients need sparse_as_dense=True during hvd_dssync's warm-up")
        dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
        if dense:
            self._allreduce_gradients(dense)
        for p, g in zip(params, dense):
            if p.grad.is_sparse:
                p.grad = g.to_sparse()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip the warm-up's gradient allreduce after an explicit ``synchronize()``."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def finish_pending(self):
        """Fold in an averaging still in flight (``overlap=True``); a collective on every rank."""
        if self._pending is None:
            return
        if self._world_changed():
            # Horovod was re-initialized (elastic reset): the averaging died with the old world, and
            # the model keeps this rank's own update.
            self._pending = None
            return
        handle, sent, received, action, started, nbytes = self._pending
        self._pending = None
        with self._bounded(action, self.sync_step - 1):
            hvd.synchronize(handle)
        with torch.no_grad():
            for (_, tensor), before, averaged in zip(self._averaged, sent, received):
                tensor.add_(averaged - before)
        self._record(action, time.perf_counter() - started, nbytes)

    def state_dict(self):
        self.finish_pending()
        state = super(self.__class__, self).state_dict()
        state["dssync"] = {"sync_step": self.sync_step, "config": self._plan.config(),
                           "arguments": _portable(self._plan_arguments)}
        return state

    def load_state_dict(self, state_dict):
        """Load a state saved by ``state_dict()``, DS-Sync's step included.

        A state saved in a world of the same size must have the same schedule configuration; one saved
        in a world of another size (elastic Horovod, or a job restarted on more or fewer ranks) must have
        been built with the same arguments, and the schedule is that of the current world.
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
        super(self.__class__, self).load_state_dict(state_dict)

    # --- the mechanics ----------------------------------------------------------------------

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
        self._generation = self._registry.refresh()
        self._world_check_pending = False
        arguments = arguments_for_world(self._plan_arguments, hvd.size())
        self._plan = _make_plan(arguments)
        self.sync_step = self._check_ranks_agree(with_step=True)

    def _average_model(self, action):
        self.finish_pending()
        if self._plan.world_size == 1 or action.kind == LOCAL:
            self._record(action, 0.0, 0)
            return
        change = self._plan.window_change(self.sync_step)
        if change is not None:
            acquire, release = change
            self._registry.acquire(acquire)
            self._registry.release(release)
        process_set = hvd.global_process_set if action.kind == GLOBAL else self._registry.get(action.group)
        tensors = [t.data for _, t in self._averaged]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sent_bytes = ring_allreduce_bytes(len(action.group), nbytes)
        name = f"dssync.{action.kind}.{process_set.process_set_id}"
        started = time.perf_counter()
        if self._overlap:
            sent = [t.detach().clone() for t in tensors]
            received = [t.clone() for t in sent]
            handle = hvd.grouped_allreduce_async_(received, name=name, op=hvd.Average, process_set=process_set)
            self._pending = (handle, sent, received, action, started, sent_bytes)
            return
        compressed, contexts = zip(*(self._compression.compress(t) for t in tensors))
        with self._bounded(action, self.sync_step):
            if all(c is t for c, t in zip(compressed, tensors)):
                hvd.grouped_allreduce_(list(tensors), name=name, op=hvd.Average, process_set=process_set)
            else:
                averaged = hvd.grouped_allreduce(list(compressed), name=name, op=hvd.Average,
                                                 process_set=process_set)
                for t, a, ctx in zip(tensors, averaged, contexts):
                    t.copy_(self._compression.decompress(a, ctx))
        self._record(action, time.perf_counter() - started, sent_bytes)

    def _allreduce_gradients(self, grads):
        prescale, postscale = 1.0, 1.0
        op = self._op
        if op == hvd.Average and self._gradient_predivide_factor != 1.0:
            prescale = 1.0 / self._gradient_predivide_factor
            postscale = self._gradient_predivide_factor
        compressed, contexts = zip(*(self._compression.compress(g) for g in grads))
        with self._bounded(self._plan.action(self.sync_step), self.sync_step):
            reduced = hvd.grouped_allreduce(list(compressed), name="dssync.bsp", op=op,
                                            prescale_factor=prescale, postscale_factor=postscale)
        for g, r, ctx in zip(grads, reduced, contexts):
            g.copy_(self._compression.decompress(r, ctx))

    @contextlib.contextmanager
    def _bounded(self, action, step):
        """Bound the wait for ``action``'s group (see :mod:`hvd_dssync.watchdog`); name it if it expires."""
        what = describe_wait(hvd.rank(), action.group, step, action.kind)
        try:
            with self._watchdog.watching(what):
                yield
        except Exception as e:  # Horovod's error after the watchdog shut it down: say why instead
            if self._watchdog.expired is None:
                raise
            self._watchdog.wait_for_shutdown()
            raise RuntimeError(self._watchdog.expired) from e

    def _record(self, action, seconds, nbytes):
        self.last_sync = {"step": self.sync_step, "kind": action.kind, "group": action.group,
                          "seconds": seconds, "bytes_sent": nbytes}

    def _check_ranks_agree(self, with_step=False):
        """One allgather of the configuration: every rank raises the same error, naming what differs.

        With ``with_step``, the step is gathered along and rank 0's is returned.
        """
        shapes = [(name, tuple(t.shape), str(t.dtype)) for name, t in self._averaged]
        options = {"overlap": self._overlap, "backward_passes_per_step": self.backward_passes_per_step,
                   "op": str(self._op)}
        mine = agreement_payload(agreement_fields(self._plan, shapes, options, step=self.sync_step))
        gathered = hvd.allgather(torch.from_numpy(mine), name="dssync.agreement").numpy()
        ranks = check_agreement(gathered, what="hvd_dssync.torch.DistributedOptimizer")
        return ranks[0]["step"] if with_step else self.sync_step


def _make_plan(arguments):
    return SyncPlan(hvd.rank(), hvd.size(), **arguments)


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


def DistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         groups=None, sparse_as_dense=False, process_set=hvd.global_process_set, *,
                         num_groups=None, group_size=None, seed=0, schedule=None, topology=None,
                         warmup_steps=0, global_every=0, average_every=1, model=None, average_buffers=True,
                         overlap=False, schedule_options=None):
    """Wrap ``optimizer`` so that ranks average their models in shuffled groups (DS-Sync).

    Drop-in for ``hvd.DistributedOptimizer``: it takes the same arguments and returns an instance of
    ``optimizer``'s class. Each rank steps on its own gradient, then averages the model inside the group
    its schedule gives it for this step; the groups shuffle from step to step so that all models reach
    consensus. No gradient is allreduced outside the warm-up.

    Horovod's arguments keep their meaning where it applies: ``compression`` compresses the averaged
    tensors; ``op`` (Average or Sum), ``gradient_predivide_factor`` and ``sparse_as_dense`` apply to the
    warm-up's gradient allreduce; ``backward_passes_per_step`` gradients simply accumulate between
    steps; ``groups`` (Horovod's fusion grouping) is accepted and has nothing to act on, since the whole
    model is one grouped allreduce per step. ``op=hvd.Adasum`` and a ``process_set`` other than the global
    one are rejected. Horovod's deprecated ``num_groups`` (tensor fusion groups) is replaced by DS-Sync's
    ``num_groups``.

    Without DS-Sync arguments the schedule is chosen from the job: "topology" when the racks are known
    (``topology=`` or ``HVD_DSSYNC_TOPOLOGY``), else random groups ("shuffle") of
    :func:`hvd_dssync.plan.default_group_size` (pairs for 4 ranks, groups of 4 from 8 ranks on).

    Args (keyword-only, DS-Sync's own):
        num_groups: groups per step (schedule "shuffle"); or give ``group_size``; or neither (the default).
        group_size: the largest group size ("shuffle"), or the butterfly's group size.
        seed: integer seed shared by all ranks.
        schedule: "shuffle", "butterfly", "topology", a schedule object with ``groups(step)``, or None
            (the default: "topology" where the racks are known, else "shuffle").
        topology: racks for schedule "topology" (a Topology, a JSON file, or lists of ranks).
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

    Example::

        import horovod.torch as hvd
        import hvd_dssync.torch as dss

        hvd.init()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model,
                                       num_groups=2, seed=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    check_horovod_arguments(hvd, op, gradient_predivide_factor, backward_passes_per_step, process_set)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Arg ``optimizer`` must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if overlap and compression is not hvd.Compression.none:
        raise ValueError("Arg ``compression`` is not supported with overlap=True.")
    named_parameters = _check_named_parameters(optimizer, named_parameters)
    schedule, num_groups, group_size = resolve_schedule(schedule, num_groups, group_size, topology)
    if topology is not None or schedule == "topology":
        from .functions import job_topology
        topology = job_topology(topology)
    plan_arguments = dict(schedule=schedule, num_groups=num_groups, group_size=group_size, seed=seed,
                          topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                          average_every=average_every, schedule_options=schedule_options)
    plan = _make_plan(plan_arguments)
    if hvd.size() == 1 and overlap:
        warnings.warn("overlap=True does nothing with one rank.")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DSSyncOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense, plan, plan_arguments, model, average_buffers, overlap)
