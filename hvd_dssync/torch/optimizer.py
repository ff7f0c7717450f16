"""DS-Sync ``DistributedOptimizer`` for PyTorch: Horovod's signature, DS-Sync's step.

One training step, in order (:meth:`DSSyncOptimizer.step`): the wrapped optimizer steps on this
rank's own gradient; the model (parameters and floating-point buffers) is averaged inside this step's group
with one grouped allreduce on the group's Horovod process set; the step is counted. During a
bulk-synchronous warm-up the step is Horovod's instead: gradients are averaged over all ranks first, and no
model averaging follows.

The optimizer is Horovod's interface over parts with one job each, which it holds and builds with what
each needs: the averaging (:mod:`.averaging`), the sparse rows of embedding tables (:mod:`.sparse_rows`), the
adaptive policy's figures (:mod:`.adaptive_step`), the step guard (:mod:`.step_guard`), sensing the racks
again (:mod:`.resensing`). Each call hands them the world the step runs in (:class:`hvd_dssync.world.World`:
plan, scope, process set, joined ranks) and the step; the averaging returns what it did
(:class:`hvd_dssync.world.Done`), which becomes ``last_sync``. It uses mixed precision's helpers (:mod:`.amp`),
Horovod's argument rules (:mod:`.arguments`) and writes its checkpoint entry with :mod:`.checkpoint`. The exit
drain (:mod:`.exit`) and ``hvd.join()`` (:mod:`.uneven`) reach the live optimizers through :mod:`.live`.

Elastic Horovod: when ``hvd.elastic.run`` re-initializes Horovod for a new world, the next ``step()``
notices it (this rank, the world size or the registered process sets changed), rebuilds the schedule for
the new world, checks again that all ranks agree, and continues from rank 0's step.
"""
import contextlib
import logging
import os
import warnings
import weakref

import horovod.torch as hvd
import torch

from ..join import JoinState
from ..fragments import forced_fragments
from ..overlap import runs_trial
from ..plan import BSP, LOCAL, SyncPlan, check_horovod_arguments, check_ranks_agree, routes_global_averages
from ..process_sets import elastic_job, registry_for
from ..scope import acquire_registered, scope_of
from ..world import Done, World
from . import collectives
from .adaptive_step import AdaptiveStep
from .amp import amp_scaling, gradients_overflow, unscale_gradients
from .arguments import SYNCHRONIZE_WARNING
from .averaging import Averaging
from .checkpoint import check_dssync_state, dssync_state, load_dssync_state
from .exit import watch_until_exit
from .functions import allgather_job_rows
from .live import note_construction, note_step, op_prefix
from .overlap_choice import OverlapChoice
from .resensing import Resensing
from .sparse_rows import SparseRows
from .step_guard import StepGuard
from .warmup import average_gradients

__all__ = ["DSSyncOptimizer"]

log = logging.getLogger("hvd_dssync")


class DSSyncOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`: Horovod's interface, the step's
    order, the step count and elastic rejoin; the parts it holds do the rest."""

    # GradScaler then always calls step(), with ``grad_scale`` and ``found_inf`` set on the optimizer: a
    # rank whose gradient overflowed still takes part in its group's average (hvd_dssync.torch.amp).
    _step_supports_amp_scaling = True

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, process_set, config, plan, model, scope, sensed=None,
                 resensing=None, quickens=False):
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
        self._config = config  # DS-Sync's arguments (hvd_dssync.config.SyncConfig), as built: a new world's plan
        self._plan = plan
        note_construction(self)
        self._name = op_prefix(process_set.process_set_id)
        self._scope = scope
        self._registry = registry_for(hvd)
        self._generation = self._registry.refresh()
        self._step_settled = False
        self.sync_step = 0
        self.last_sync = None
        self._joins = JoinState(scope.world_size)  # ranks known to have run out of data (hvd_dssync.join)
        # The parts, each given what it needs; the world they run in comes with each call (self._world()).
        self._guard = StepGuard(self._name)
        self._sensed = None if sensed is None else sensed.to_dict()  # what topology="auto" found, and its cost
        self._adaptive = AdaptiveStep(self._name, self._guard)
        # Sparse averaging of embedding tables: which tables is agreed at the first step after the warm-up.
        self._sparse = SparseRows(self, named_parameters, self._name, config.sparse_average and not config.overlap
                                  and compression is hvd.Compression.none)
        self._averaging = Averaging(self, named_parameters, self._name, self._registry, self._guard, self._sparse,
                                    self._adaptive, model, config.average_buffers, bool(config.overlap), compression,
                                    float(config.outer_momentum))
        if config.overlap:  # the global averages in flight go in fragments where HVD_DSSYNC_GLOBAL_FRAGMENTS says
            self._averaging.global_fragments = forced_fragments(os.environ)
        # With HVD_DSSYNC_RESENSE=1 where the racks were measured: sensing again when the network changes.
        self._resensing = None if resensing is None else Resensing(self._name, *resensing, self._registry)
        # overlap=None: a trial of both ways decides (hvd_dssync.overlap), where overlap can run at all.
        trial = runs_trial(config.overlap, compression is not hvd.Compression.none, plan.adaptive is not None,
                           scope.world_size, hvd.size() > hvd.local_size())
        # Where the schedule's global averages may go through the racks or over every rank at once ("auto"),
        # the trial's probe chooses (routes_global_averages: the route waited for, or one op in flight).
        choose = (routes_global_averages(plan.schedule, "PyTorch")
                  and not routes_global_averages(plan.schedule, "PyTorch", overlapped=True))
        # Where DS-Sync picked the racks' period, the trial probes whether they hide at half of it first
        # (hvd_dssync.rhythm): the plan takes the period it asks for. Not under elastic Horovod: a newcomer's
        # plan would start from the period as built.
        quickens = quickens and not elastic_job()
        self._overlap_choice = OverlapChoice(self._name, plan, choose, quickens) if trial else None
        # Under elastic Horovod a worker that joins builds its optimizer while the others are inside
        # hvd.elastic.run's state sync, so no collective may run here; the first step checks instead.
        self._world_check_pending = elastic_job()
        if self._in_process_set():
            acquire_registered(hvd, scope, plan.schedule.window_groups(0), "hvd_dssync.torch.DistributedOptimizer",
                               allgather_rows=allgather_job_rows, ordered=self._averaging.ordered_sets)
        if not self._world_check_pending:
            self._check_ranks_agree()
            # The first window's process sets now, with the agreement: not in the first average's time.
            self._averaging.enter_window(self._world(), self.sync_step)
            collectives.warm_window_sets(self._world(), self._registry, self._name)
        watch_until_exit(self)
        if model is not None and config.overlap is not False:
            hook = model.register_forward_pre_hook(_fold_before_evaluation(weakref.ref(self)))
            weakref.finalize(self, hook.remove)  # an optimizer built again for the model leaves one hook

    # --- what users see ---------------------------------------------------------------------

    @property
    def overlap(self):
        """Whether the averages run behind compute (True where only the global averages' fragments do): True,
        False, or None while the default's trial runs (``overlap=None``: :mod:`hvd_dssync.overlap`)."""
        if self._overlap_choice is None:
            return self._averaging.overlap
        return self._overlap_choice.trial.overlapping

    @property
    def overlap_trial(self):
        """What the default's trial of overlap decided and from what it timed, as it logs it (e.g. ``"overlap on
        (the overlapped steps 12% shorter; global averages over every rank, in flight: ...)"``); None where no
        trial runs (``overlap`` given, one host)."""
        return None if self._overlap_choice is None else self._overlap_choice.trial.describe()

    @property
    def in_flight(self):
        """Whether an average runs behind the local steps (``overlap``), not yet folded in; :meth:`finish_pending`
        folds it in, as evaluating ``model`` (``model.eval()`` under ``torch.no_grad()``) does where it was given."""
        return self._averaging.in_flight

    def register_fold_hook(self, hook):
        """Call ``hook(moves)`` each time an average in flight (``overlap``) is folded in, with what the fold
        added to this rank's model: ``moves``, a list of ``(name, tensor)`` of the averaged tensors (the trained
        parameters by their names in ``named_parameters``, then ``"buffer.<name>"``), to be read during the
        call only. What the model was when the average was in flight, plus the moves, is what evaluating it
        then would have given, once the average was done: e.g. a copy of the model kept for a later evaluation.
        Returns a handle whose ``remove()`` unregisters the hook.

        Example::

            kept = {name: p.detach().clone() for name, p in model.named_parameters()}  # an average in flight
            handle = opt.register_fold_hook(lambda moves: [kept[name].add_(move) for name, move in moves
                                                           if name in kept])
            ...                            # steps: once it is folded in, kept is what evaluating the model gave
            handle.remove()
        """
        if self._config.outer_momentum:
            raise ValueError(
                f"register_fold_hook: outer_momentum={self._config.outer_momentum} moves the model after each "
                "fold by an outer step too, which the moves passed to the hook would not include")
        handle = torch.utils.hooks.RemovableHandle(self._averaging.fold_hooks)
        self._averaging.fold_hooks[handle.id] = hook
        return handle

    @property
    def sensed(self):
        """What ``topology="auto"`` found and its cost (a dict; None where nothing was sensed): where the racks
        were sensed again (:mod:`.resensing`), the last sensing's, with its step."""
        if self._resensing is not None and self._resensing.step is not None:
            return self._resensing.record()
        return self._sensed

    @property
    def schedule(self):
        """The schedule: ``schedule.groups(step)`` is identical on every rank."""
        return self._plan.schedule

    @property
    def policy(self):
        return self._plan.policy

    def step(self, closure=None):
        note_step(self)  # which optimizers a training iteration steps, and in what order (hvd.join())
        return self._take_step(closure)

    def _take_step(self, closure=None, serving=False):
        """One step of the plan. ``serving``: this rank has run out of data (``hvd.join()``): it takes part in
        the step's communication with its model as it is, and updates nothing."""
        self._settle_step()
        if self._should_synchronize and self._synchronized and not serving:
            warnings.warn(SYNCHRONIZE_WARNING)
        world, step = self._world(), self.sync_step
        early = None if self._plan.adaptive is None else self._adaptive.check_early(world, step)
        action = self._plan.action(step)
        if self._overlap_choice is not None:
            self._averaging.overlap = self._overlap_choice.overlap_at(step, self._sparse.row_sets is not None)
            self._averaging.global_fragments = self._overlap_choice.global_fragments_at(step)
        self._adaptive.drift = float("nan")
        if self._sparse.tables is None and self._sparse.enabled and action.kind != BSP:
            self._sparse.agree(self.process_set)
        loss, done = None, None
        with amp_scaling(self) as (grad_scale, found_inf):
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
                    found_inf = gradients_overflow(self.param_groups)
                if not serving:
                    loss = self._local_update(closure, grad_scale, found_inf)
                    self._sparse.note_changed()
                done = Done(action)
            else:
                if not serving:
                    loss = self._local_update(closure, grad_scale, found_inf)
                    self._sparse.note_changed()
                done = self._averaging.average_model(world, action, step)
        self._record(done)
        if self._resensing is not None:
            self._follow_network(self._resensing.end_step(world, step, done))
        if serving:
            self.finish_pending()  # what the average carried must be known at the end of the step
        if self._plan.adaptive is not None:
            decision = self._adaptive.end_step(world, step, action, done, early)
            if decision is not None:
                self.last_sync = dict(self.last_sync or {"step": step, "kind": action.kind},
                                      decision=decision.as_dict())
        if self._overlap_choice is not None:
            self._overlap_choice.end_step(world, step, action.kind == LOCAL,
                                          lambda: [t for _, t in self._averaging.tensors()], done)
            self._follow_trial(step + 1)
        self._synchronized = False
        self.sync_step += 1
        return loss

    def synchronize(self):
        """Average the gradients over all ranks now, during a bulk-synchronous warm-up step.

        As with Horovod: call it before clipping gradients, then ``step()`` inside
        ``skip_synchronize()``. Outside the warm-up, gradients stay local and this does nothing.
        """
        self._settle_step()
        if not self._synchronized and self._plan.policy.action(self.sync_step) == BSP:
            average_gradients(self._world(), self.sync_step, self._named_parameters, self._compression, self._guard,
                              self._name, self.op, self.gradient_predivide_factor, self.sparse_as_dense)
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
        """Fold in an averaging still in flight (``overlap=True``), waiting for this rank's own op; it issues no
        other op, so one rank may call it alone (before reading its model); ``synchronize_models`` calls it on
        every rank."""
        if self._world_changed():
            self._averaging.drop_pending()  # it died with the old world: the model keeps this rank's update
            return
        self._record(self._averaging.finish_pending(self._world()))

    def state_dict(self):
        self.finish_pending()
        state = super(self.__class__, self).state_dict()
        state["dssync"] = dssync_state(self.sync_step, self._plan, self._config, self._averaging, self._sparse,
                                       self.sensed)
        return state

    def load_state_dict(self, state_dict):
        """Load a state saved by ``state_dict()``, DS-Sync's step included (:mod:`.checkpoint`).

        Loaded on rank 0 alone before the first step (Horovod's recipe), the step reaches the other ranks
        at that first step.
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop("dssync", None)
        if saved is not None:
            # Before the collective below: a clear error.
            check_dssync_state(saved, self._plan, self._config, self.sensed)
            self.finish_pending()
            self.sync_step = load_dssync_state(saved, self._plan, self._config, self._averaging, self._sparse,
                                                 self.sensed)
        self._synchronized = False
        super(self.__class__, self).load_state_dict(state_dict)

    # --- the step, the world and the scope ---------------------------------------------------

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
        step (a collective: one broadcast of a few float64 numbers, cheaper than ``broadcast_object``)."""
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
            raise RuntimeError(collectives.SHUT_DOWN) from None
        return generation != self._generation

    def _join_world(self):
        """Take up the current world: every rank of it calls this at the same step (a collective).

        The schedule is rebuilt for the new world size, the agreement check runs again, and every rank
        continues from rank 0's step: the rank whose model and optimizer state ``hvd.elastic.TorchState``
        broadcast to the newcomers.
        """
        self._averaging.forget()
        # Elastic Horovod has just broadcast rank 0's model to every rank: no row differs, and the
        # newcomers agree on the sparse tables with the others at the next averaging step.
        self._sparse.forget()
        self._generation = self._registry.refresh()
        self._world_check_pending = False
        config = self._config.for_world(hvd.size())  # self._config stays as built, for later worlds
        self._scope = scope_of(hvd, hvd.global_process_set)  # elastic jobs train in the whole job
        self._joins = JoinState(self._scope.world_size)
        adaptive = self._plan.adaptive
        self._plan = SyncPlan.from_config(self._scope.rank, self._scope.world_size, config)
        if adaptive is not None:
            self._plan.adaptive.load(adaptive.state())
        self.sync_step = self._check_ranks_agree(with_step=True)
        self._take_state(0, with_step=False)  # a newcomer's decision is rank 0's, as its step

    def _follow_trial(self, step):
        """The racks' period the trial asks for (:mod:`hvd_dssync.rhythm`), from the plan's first period from ``step``
        on, the first step not taken yet (every rank at the same step)."""
        every = None if self._overlap_choice is None else self._overlap_choice.trial.average_every
        if every is not None and every != self._plan.policy.average_every:
            start = self._plan.change_period(step, every)
            if self._scope.rank == 0:
                log.info(f"hvd_dssync: the racks average every {every} steps from step {start}")

    def _follow_network(self, config):
        """Train on ``config`` from the next step on (the racks sensed again: :mod:`.resensing`), or go on as
        before where it is None. Every rank follows at the same step: the registry's changes are collectives."""
        if config is None:
            return
        self.finish_pending()  # an average in flight runs on the old groups' process sets
        leaving = self._plan.leave_window()
        self._config = config
        self._plan = SyncPlan.from_config(self._scope.rank, self._scope.world_size, config)
        self._follow_trial(self.sync_step + 1)
        self._averaging.follow_schedule()
        self._averaging.enter_window(self._world(), self.sync_step + 1)  # registered ahead: no collective
        self._registry.release(leaving)
        self._registry.release_unused()  # registered ahead for a window the new plan did not start in

    # --- hvd.join()'s protocol (hvd_dssync.torch.uneven.join drives it): this rank ran out of data --

    def start_serving(self):
        """This rank joins (``hvd.join()``): it takes part in its groups' averages from now on, updating
        nothing."""
        if self._plan.adaptive is not None:
            raise RuntimeError("hvd_dssync: hvd.join() is not supported with policy='adaptive': its future steps "
                               "depend on figures not measured yet, so the ranks could not agree when to leave.")
        if self._in_process_set():
            raise RuntimeError("hvd_dssync: hvd.join() joins the whole job, but this optimizer trains inside a "
                               "process set; make every rank take the same number of steps instead.")
        self._joins.note_joined(self._scope.rank, self.sync_step)

    def serve_joined(self):
        """One step with this rank's model as it is; ``True`` once every rank has left."""
        self._take_step(serving=True)
        leave = self._joins.leave_step(self._plan.partition)
        return leave is not None and self.sync_step > leave

    def stop_serving(self):
        """Every rank has left: the rank that joined last (Horovod's ``join`` returns it)."""
        last = self._joins.last_to_join()
        self._joins.reset()
        return last

    def _in_process_set(self):
        return self.process_set is not hvd.global_process_set

    def _world(self):
        """What the parts need of the world this optimizer steps in now (:class:`hvd_dssync.world.World`)."""
        return World(self._plan, self._scope, self.process_set, self._joins, self._in_process_set())

    def _record(self, done):
        """``last_sync`` from what a step's synchronization did (:class:`hvd_dssync.world.Done`; None: nothing)."""
        if done is None:
            return
        action = done.action
        self.last_sync = {"step": self.sync_step, "kind": action.kind, "group": self._scope.to_global(action.group),
                          "seconds": done.seconds, "bytes_sent": done.bytes_sent}
        if self._sparse.row_sets is not None:
            self.last_sync.update(sparse_rows=done.sparse_rows, row_set=self._sparse.row_sets.total())

    def _check_ranks_agree(self, with_step=False):
        """One allgather of the configuration: every rank raises the same error, naming what differs.

        With ``with_step``, the step is gathered along and rank 0's is returned.
        """
        shapes = [(name, tuple(t.shape), str(t.dtype)) for name, t in self._averaging.tensors()]
        options = {"overlap": self._config.overlap, "backward_passes_per_step": self.backward_passes_per_step,
                   "op": str(self.op), "op names": self._name, "outer_momentum": float(self._config.outer_momentum)}

        def allgather(payload):
            return hvd.allgather(torch.from_numpy(payload), name="dssync.agreement",
                                 process_set=self.process_set).numpy()

        ranks = check_ranks_agree(allgather, self._plan, shapes, options, "hvd_dssync.torch.DistributedOptimizer",
                                  step=self.sync_step)
        return ranks[0]["step"] if with_step else self.sync_step

    def _local_update(self, closure, grad_scale, found_inf):
        """The wrapped optimizer's step on this rank's gradient, unless GradScaler found inf or NaN in it."""
        if found_inf is not None and bool(found_inf):
            return None
        if grad_scale is not None:  # scaler.step() without scaler.unscale_() first
            unscale_gradients(self.param_groups, grad_scale)
        return super(self.__class__, self).step(closure)


def _fold_before_evaluation(optimizer_ref):
    """A forward pre-hook for the model: evaluating it (``model.eval()`` and no gradient, as under
    ``torch.no_grad()``) folds in the average in flight first (``overlap``), so that the model evaluated is the
    one an average waited for would have left; this rank alone waits for its own op, no other op is issued.
    A forward pass that may train (training mode, or ``model.eval()`` with gradients, as where BatchNorm is
    frozen) leaves it in flight: the step polls."""
    def hook(module, args):
        optimizer = optimizer_ref()
        if not module.training and not torch.is_grad_enabled() and optimizer is not None and optimizer.in_flight:
            optimizer.finish_pending()
    return hook
