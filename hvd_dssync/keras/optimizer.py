"""DS-Sync ``DistributedOptimizer`` for Keras: Horovod's signature, DS-Sync's step.

One training step, in :meth:`apply_gradients`, in order: in a bulk-synchronous warm-up step the
gradients are first averaged over all ranks (Horovod's step); the wrapped optimizer applies them, which
counts the step in ``iterations``; then the model (trainable variables and floating-point
non-trainable ones such as BatchNorm statistics) is averaged inside the group the schedule gives this
rank for the step. The group is chosen in the graph from the step tensor (see :mod:`.sync`), so one
traced ``train_function`` follows the schedule step after step.

Elastic Horovod: under ``hvd.elastic.run`` the ranks check their agreement and register the process sets
when the step is first traced, not at construction; ``hvd_dssync.keras.elastic.KerasState`` rebuilds the
schedule for a new world and drops the traced ``train_function`` (see :mod:`.elastic`).
"""
import os
import warnings
import weakref

import horovod.tensorflow as hvd
import tensorflow as tf

from .. import build, horovod_loop
from ..config import config_of, warn_num_groups
from ..fragments import forced_fragments
from ..plan import check_horovod_arguments
from ..process_sets import elastic_job
from ..scope import acquire_registered
from .functions import allgather_job_rows, default_topology, job_topology
from .local_steps import LocalSteps, gradient_names
from .outside import OutsideProcessSet
from .sparse_rows import changes_other_rows
from .sync import StepSync, make_plan, skip_instance

__all__ = ["DistributedOptimizer", "step_sync_of"]


def step_sync_of(optimizer):
    """The :class:`.sync.StepSync` of a DS-Sync Keras optimizer (inside a loss-scale wrapper too), or None for
    any other optimizer: what the callbacks read (its plan, its parts' figures).

    Example::

        sync = step_sync_of(model.optimizer)
        sync.guard.sync_seconds      # wall time this rank spent in its averages
    """
    return getattr(getattr(optimizer, "inner_optimizer", optimizer), "_dssync", None)


_WHAT = "hvd_dssync.keras.DistributedOptimizer"


class _DSSyncOptimizer(LocalSteps):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer` on the process set's ranks."""

    def _dssync_setup(self, sync, model, options):
        """``sync`` holds DS-Sync's configuration (``sync.config``); ``options`` are the other arguments the
        ranks must agree on, by name."""
        self._dssync = sync
        self._dssync_sparse_average = sync.config.sparse_average and not sync.config.overlap
        # A weak reference: the model owns the optimizer, and a tracked model here would be saved twice.
        self._dssync_model = None if model is None else weakref.ref(model)
        self._dssync_average_non_trainable = sync.config.average_buffers
        self._dssync_options = options
        if not elastic_job():
            # Under elastic Horovod a joining worker builds its optimizer while the others sync state, so
            # no collective may run here: the first trace of the step connects instead (apply_gradients).
            # What each rank averages is compared there too: a model may come later (set_model).
            self._dssync.connect(_WHAT, options=options)

    @property
    def schedule(self):
        """The schedule: ``schedule.groups(step)`` is identical on every rank."""
        return self._dssync.plan.schedule

    @property
    def policy(self):
        return self._dssync.plan.policy

    @property
    def overlap(self):
        """Whether the averages run behind compute: True, False, or None while the default's trial runs
        (``overlap=None``: :mod:`hvd_dssync.overlap`)."""
        return self._dssync.overlap

    @property
    def overlap_trial(self):
        """What the default's trial of overlap decided and from what it timed, as it logs it; None where no
        trial runs (``overlap`` given, one host)."""
        return self._dssync.overlap_trial

    @property
    def dssync_decisions(self):
        """The adaptive policy's decisions so far (dicts, as the PyTorch adapter's ``last_sync["decision"]``)."""
        return self._dssync.adaptive.decisions

    def _allreduce_grads(self, grads, vars=None):
        """``grads`` averaged over all ranks, as Horovod's (and DS-Sync's warm-up) gradient allreduce.

        ``None`` entries stay ``None``. A collective: call it on every rank.
        """
        return self._dssync.allreduce_gradients(list(grads))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return super(self.__class__, self).apply_gradients(grads_and_vars, *args, **kwargs)
        grads, variables = (list(x) for x in zip(*grads_and_vars))
        averaged = self._dssync_averaged(variables)
        object.__setattr__(self, "_dssync_traced", True)  # what it averages is fixed in the traced step now
        shapes = [(i, tuple(v.shape), v.dtype.name) for i, v in enumerate(averaged)]
        self._dssync.ensure_connected(_WHAT, shapes, self._dssync_options)
        tables = self._dssync_row_tables(grads, variables, averaged)
        self._dssync.sparse.use([variables[i] for i in tables])
        # The wrapped optimizer's own gradient aggregation runs inside; it is not a wrapper's call.
        object.__setattr__(self, "_dssync_applying", True)
        try:
            with tf.control_dependencies([self._dssync.adopt_root_step(self.iterations)]):
                first_pass = tf.equal(tf.math.floormod(self.iterations, self._dssync_passes), 0)
                started = self._dssync.sparse.start(first_pass)
            with tf.control_dependencies([started]):
                touched = self._dssync.sparse.touch([grads[i].indices for i in tables])
            with tf.control_dependencies([touched]):
                if self._dssync_passes == 1:
                    iteration, _ = self._dssync_step(grads, variables, averaged, tf.identity(self.iterations),
                                                     args, kwargs)
                    return iteration
                return self._dssync_accumulate(grads, variables, averaged, args, kwargs)
        finally:
            object.__setattr__(self, "_dssync_applying", False)

    def _dssync_step(self, grads, variables, averaged, step, args, kwargs):
        """One DS-Sync step: the warm-up's gradient allreduce, this rank's update, the group average.

        Returns what the wrapped optimizer's ``apply_gradients`` returned, and the average's op. Local
        variables (:meth:`register_local_var`) are neither allreduced nor averaged, and their gradients are
        scaled as Horovod's (:meth:`_dssync_scale_local`).
        """
        shared = [i for i, v in enumerate(variables) if v.ref() not in self._dssync_local_vars]
        reduced = self._dssync.gradients([grads[i] for i in shared], step)
        for i, g in zip(shared, reduced):
            grads[i] = g
        grads = self._dssync_scale_local(grads, variables)
        if not _is_loss_scale_optimizer(self):
            iteration = super(self.__class__, self).apply_gradients(zip(grads, variables), *args, **kwargs)
            with tf.control_dependencies([iteration]):
                return iteration, self._dssync.average(averaged, step)
        # This optimizer is a loss-scale one: every rank skips its update together, and then its average too,
        # as when a LossScaleOptimizer wraps this one.
        grads, finite = self._dssync.shared_finiteness(grads)
        iteration = super(self.__class__, self).apply_gradients(zip(grads, variables), *args, **kwargs)
        # Keras' new LossScaleOptimizer returns nothing; the average reads the variables it updates, which
        # orders it after the update inside a tf.function.
        with tf.control_dependencies([] if iteration is None else [iteration]):
            return iteration, tf.cond(finite, lambda: tf.group(self._dssync.average(averaged, step)), tf.no_op)

    def aggregate_gradients(self, grads_and_vars):
        """Keras' hook for a wrapper's cross-replica aggregation: here, a shared verdict on finiteness.

        ``LossScaleOptimizer(dss.DistributedOptimizer(opt))`` (what ``model.compile`` builds under a
        ``mixed_float16`` policy) calls it before its finiteness check; see :meth:`StepSync.shared_finiteness`.
        """
        return super(self.__class__, self).aggregate_gradients(self._dssync_shared_finiteness(grads_and_vars))

    def _aggregate_gradients(self, grads_and_vars):
        """:meth:`aggregate_gradients` of Keras' legacy optimizers."""
        return super(self.__class__, self)._aggregate_gradients(self._dssync_shared_finiteness(grads_and_vars))

    def _dssync_shared_finiteness(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if getattr(self, "_dssync_applying", False) or not grads_and_vars:
            return grads_and_vars
        grads, variables = zip(*grads_and_vars)
        grads, _ = self._dssync.shared_finiteness(list(grads))
        return list(zip(grads, variables))

    def _dssync_row_tables(self, grads, variables, averaged):
        """Positions of the embedding tables to average by their rows (``sparse_average``), decided at trace time.

        A table qualifies if its gradient is an ``IndexedSlices`` and the wrapped optimizer changes only the
        rows of its gradients; otherwise it is averaged densely, with a warning. Every rank traces the same
        model, so every rank finds the same tables.
        """
        if not self._dssync_sparse_average or self._dssync.plan.world_size == 1 or \
                self._dssync.compression is not hvd.Compression.none:
            return []
        shared = {v.ref() for v in averaged}
        sparse = [i for i, (g, v) in enumerate(zip(grads, variables))
                  if isinstance(g, tf.IndexedSlices) and v.ref() in shared]
        if not sparse:
            return []
        # Gradients reach the wrapped optimizer dense after a warm-up's cond or a sum over passes.
        with tf.init_scope():  # the optimizer's configuration, read eagerly
            why = changes_other_rows(self, self._dssync.plan.policy.warmup_steps > 0 or self._dssync_passes > 1)
        if why:
            warnings.warn(f"hvd_dssync: {', '.join(variables[i].name for i in sparse)} averaged densely: sparse "
                          f"averaging needs an optimizer that changes only the rows of its gradients, and {why}.")
            return []
        return sparse

    def _dssync_averaged(self, variables):
        """The variables averaged each step: the trained ones, plus the model's float non-trainables."""
        averaged = [v for v in variables if v.ref() not in self._dssync_local_vars]
        model = None if self._dssync_model is None else self._dssync_model()
        if model is not None and self._dssync_average_non_trainable:
            seen = {v.ref() for v in averaged} | self._dssync_local_vars
            averaged += [v for v in model.non_trainable_variables
                         if v.dtype.is_floating and v.ref() not in seen]
        return averaged

    def synchronize(self):
        """Fold in the average in flight (``overlap=True``) now, eagerly; nothing otherwise. A collective's end:
        call it on every rank (``synchronize_models`` does)."""
        self._dssync.drain()

    def set_model(self, model):
        """Average ``model``'s float non-trainable variables (BatchNorm statistics) with the trained ones, as
        ``model=`` does; for an optimizer built before its model (``load_model`` calls it). Call it before the
        first step is traced: a traced step keeps the variables it found."""
        if not isinstance(model, tf.keras.Model):
            raise TypeError(f"Arg ``model`` must be a tf.keras.Model, got {type(model).__name__}.")
        if getattr(self, "_dssync_traced", False):
            raise RuntimeError("hvd_dssync: set_model after the step was traced would change nothing: call it "
                               "before the first step (or pass model= to DistributedOptimizer).")
        self._dssync_model = weakref.ref(model)

    def follow_world(self):
        """Rebuild the schedule for Horovod's current world after an elastic reset (:class:`.elastic.KerasState`
        calls it); no communication."""
        self._dssync.rebuild()


def _optimizer_class(optimizer, mixin):
    """The user's optimizer class with ``mixin``'s methods (and its bases', below :class:`LocalSteps`), and the
    gradient method of Horovod's two names it lacks (:func:`.local_steps.gradient_names`).

    The same class name and module, so a saved model names the plain optimizer (as Horovod's).
    """
    methods = gradient_names(optimizer.__class__)
    for klass in (LocalSteps, mixin):
        methods.update({k: v for k, v in klass.__dict__.items() if k not in ("__dict__", "__weakref__")})
    methods["__module__"] = optimizer.__class__.__module__
    return type(optimizer.__class__.__name__, (optimizer.__class__,), methods)


def _is_loss_scale_optimizer(optimizer):
    return isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)


def _is_keras_optimizer(optimizer):
    return isinstance(optimizer, (tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer))


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=hvd.Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=hvd.Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=hvd.global_process_set, scale_local_gradients=True,
                         *, group_size=None, seed=0, schedule=None, topology="auto",
                         warmup_steps=0, global_every=None, average_every=None, model=None, average_non_trainable=True,
                         schedule_options=None, policy=None, sparse_average=True, overlap=None, sync=None):
    """Wrap a Keras optimizer so that ranks average their models in shuffled groups (DS-Sync).

    Drop-in for ``horovod.tensorflow.keras.DistributedOptimizer``: it takes the same arguments and
    returns an optimizer of the same class, built from ``optimizer.get_config()`` as Horovod does, so
    ``model.compile``, learning-rate schedules, Horovod's callbacks and saved models keep working
    (a saved model loads without hvd_dssync as the plain optimizer). Each rank applies its own
    gradient, then averages its model inside the group its schedule gives it for this step; the group
    is chosen in the graph, so it changes step by step inside one traced ``model.fit``.

    Horovod's arguments keep their meaning where it applies: ``compression`` and ``process_set`` as in
    the PyTorch adapter (a lossy compressor sends compressed differences from a shared reference; the
    groups of a process set are registered beforehand on every rank with :func:`add_process_set_groups`);
    ``op`` (Average or Sum), ``gradient_predivide_factor``, ``sparse_as_dense`` and
    ``device_dense`` apply to the warm-up's gradient allreduce; ``name`` names the Horovod ops.
    ``backward_passes_per_step`` passes sum their gradients (their mean with
    ``average_aggregated_gradients``) and every last one steps, as in Horovod: ``iterations`` counts the
    passes, the DS-Sync step the applied steps. Variables given to ``register_local_var`` are neither
    allreduced nor averaged, and with ``scale_local_gradients`` (the default) their gradients are divided
    by the process set's size, as in Horovod. On a rank outside ``process_set`` the arguments are validated
    as on its ranks, and the optimizer steps alone and sends nothing, as Horovod's there
    (:mod:`.outside`). ``device_sparse`` and ``groups`` have nothing to act on and are accepted for
    compatibility. ``op=hvd.Adasum`` is rejected. The arguments Horovod has come in Horovod's order with
    Horovod's defaults, so a script passing them by position means the same; Horovod's deprecated
    ``num_groups`` (fusion groups, default 0) is DS-Sync's number of groups, 0 choosing it as without it; a
    ``HorovodArgumentWarning`` says so where it is given (nothing is said for it in ``sync``).

    DS-Sync's own arguments follow (keyword-only, but ``num_groups``, at Horovod's position).

    Args:
        num_groups: groups per step (schedule "shuffle"); or give ``group_size``; or neither (0): the default
            schedule of :func:`hvd_dssync.torch.DistributedOptimizer` (the same in both adapters).
        group_size: the largest group size ("shuffle"), or the butterfly's group size.
        seed: integer seed shared by all ranks; the same seed gives the PyTorch adapter's groups.
        schedule: "shuffle", "butterfly", "topology", a schedule object with ``groups(step)``, or None (the
            default: "topology" where the racks are known, else "shuffle").
        topology: racks for schedule "topology" (as in the PyTorch adapter); "auto" (the default) senses
            them once per job where no other DS-Sync argument names the schedule (:mod:`hvd_dssync.sensing`),
            and keeps them (PyTorch's may sense again: :mod:`hvd_dssync.resense`).
        warmup_steps: bulk-synchronous steps first (gradient allreduce over all ranks).
        global_every: average over all ranks every this many steps (0: never). Default (None): 32 where the
            optimizer picks the topology-aware schedule itself, and there the racks meet only in these
            averages (``intra_steps=None`` unless ``schedule_options`` names it), else 0
            (``hvd_dssync.config.default_rack_rhythm``).
        average_every: average every this many steps; the steps between are local (local SGD). Default
            (None): 8 where the optimizer picks the topology-aware schedule itself (racks sensed or given, no
            ``schedule``), 8 where it sensed hosts on one flat network (one group of every rank), else 1
            (``hvd_dssync.config.default_average_every``).
        model: the Keras model; its float non-trainable variables (BatchNorm statistics) are averaged too.
            Without it only the trainable variables are (``model.fit`` hands the optimizer nothing else), and
            each rank keeps its own statistics, as with Horovod.
        average_non_trainable: set False to keep the model's non-trainable variables local.
        schedule_options: extra arguments for the named schedule. Shuffle defaults to
            ``window_steps=None`` here: its partitions never change (see docs/keras.md).
        policy: None or "fixed" (the periods above), or "adaptive" (or an
            :class:`hvd_dssync.adaptive.AdaptivePolicy`): as in the PyTorch adapter, the ranks choose
            together between global and group averages and the period, from what their averages cost.
            The traced step reads the window's branches from a variable that
            :class:`hvd_dssync.keras.callbacks.SyncStatsCallback` sets at each decision step: pass that
            callback to ``model.fit`` (``steps_per_execution=1``).
        sparse_average: average embedding tables whose gradients are ``IndexedSlices`` (``Embedding``) over
            only the rows that can differ between the members (:mod:`hvd_dssync.sparse`), as the PyTorch
            adapter: the dense average's result, at a cost proportional to the rows in play. Needs SGD
            without momentum (or the legacy SGD's lazy momentum) or Adagrad; another optimizer, or a lossy
            ``compression``, averages densely. ``False``: dense.
        overlap: True starts each average on a thread of its own: it runs behind the local steps that follow
            and is folded in at the first step that finds it done, at the latest where the next average starts
            (a global average, the step after it started: :func:`hvd_dssync.overlap.folds_now`;
            ``model += average - sent``, keeping the progress made meanwhile; :mod:`hvd_dssync.keras.overlap`).
            A global average goes whole, or in ``HVD_DSSYNC_GLOBAL_FRAGMENTS`` fragments, each sent at a step of
            its own and folded in at the next (:mod:`hvd_dssync.fragments`). ``synchronize_models``, the exit and
            ``SynchronizeModelsCallback`` before an evaluation fold it in first (:meth:`synchronize`). Not with a
            lossy ``compression``, the adaptive policy or elastic Horovod; embedding tables are then averaged
            densely. None (the default): where the averages cross hosts, a trial of both ways after the warm-up
            decides, alike on every rank (:mod:`hvd_dssync.overlap`; :attr:`overlap` is None until then), as in
            the PyTorch adapter, the global averages' fragments on their own, and on racks whose period DS-Sync
            chose, the probe of the racks every half period first (:mod:`hvd_dssync.rhythm`); off on one host,
            under elastic Horovod, with a lossy ``compression``, the adaptive policy or a table averaged by its
            rows. False: every average is waited for.
        sync: a :class:`hvd_dssync.SyncConfig` holding every DS-Sync argument above, instead of them (the
            same object builds the PyTorch optimizer and registers the groups: :func:`init`,
            :func:`add_process_set_groups`); with it, the keywords above keep their defaults. Its
            ``outer_momentum`` is PyTorch's only and refused here.

    Example::

        import horovod.tensorflow.keras as hvd
        import hvd_dssync.keras as dss

        hvd.init()
        opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()), group_size=4, seed=0,
                                       model=model)  # model=: its BatchNorm statistics are averaged too
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   dss.callbacks.SynchronizeModelsCallback()])
    """
    if not _is_keras_optimizer(optimizer):
        raise TypeError(f"Arg ``optimizer`` must be a Keras optimizer, got {type(optimizer).__name__}.")
    scope = check_horovod_arguments(hvd, op, gradient_predivide_factor, backward_passes_per_step, process_set)
    build.warn_once(hvd.rank())  # rank 0 says once what another Horovod build lacks
    horovod_loop.set_idle_cycle()  # Horovod's loop sleeps between DS-Sync's ops (docs/build.md)
    warn_num_groups(num_groups)  # Horovod's fusion groups, DS-Sync's groups here: docs/faq.md
    in_process_set = scope.world_size != hvd.size()
    # DS-Sync's own arguments, checked before any communication (hvd_dssync.config.config_of).
    config = config_of(sync, dict(num_groups=num_groups or None, group_size=group_size, seed=seed, schedule=schedule,
                                  topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                                  average_every=average_every, schedule_options=schedule_options, policy=policy,
                                  average_buffers=bool(average_non_trainable), sparse_average=bool(sparse_average),
                                  overlap=overlap),
                       in_process_set, unsupported=("outer_momentum",))
    if config.overlap:  # what a thread's average in flight cannot follow
        if compression is not hvd.Compression.none:
            raise ValueError("Arg ``compression`` is not supported with overlap=True.")
        if config.adaptive() is not None:
            raise ValueError("Arg ``policy``: the adaptive policy is not supported with overlap=True in the Keras "
                             "adapter (it times waited averages).")
        if elastic_job():
            raise ValueError("Arg ``overlap``: overlap=True is not supported under elastic Horovod in the Keras "
                             "adapter (an average in flight would cross a reset).")
    # overlap=True: in how many fragments a global average goes; a bad count named on every rank, before any op.
    fragments = forced_fragments(os.environ) if config.overlap else 1
    if model is not None and not isinstance(model, tf.keras.Model):
        raise TypeError(f"Arg ``model`` must be a tf.keras.Model, got {type(model).__name__}.")
    # topology="auto": the racks sensed once per job (hvd_dssync.sensing), or None where there is one rack.
    requested = config
    config, sensed = config.resolve(default_topology, job_topology, in_process_set, routes=False)
    # Where DS-Sync picked the racks' period, the trial of overlap may halve it (hvd_dssync.rhythm).
    quickens = requested.quickens_racks(config)
    op_name = name or f"DSSync{type(optimizer).__name__}"
    if scope.outside:
        # This rank trains alone, as with Horovod: validated as the set's ranks are (at the set's first
        # position, the same errors), its groups only checked, and nothing sent.
        plan = make_plan(config, scope=scope._replace(rank=0))
        acquire_registered(hvd, scope, plan.schedule.window_groups(0), "hvd_dssync.keras", take=False,
                           allgather_rows=allgather_job_rows)
        # The set's ranks number their DS-Sync objects for op names; a later optimizer's names must match.
        skip_instance()
        return _optimizer_class(optimizer, OutsideProcessSet).wrapping(
            optimizer, (process_set, scope.world_size, backward_passes_per_step, average_aggregated_gradients,
                        scale_local_gradients), sparse_as_dense=sparse_as_dense)
    step_sync = StepSync(make_plan(config, scope=scope if in_process_set else None), compression=compression,
                         op=op, gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
                         device_dense=device_dense, name=op_name, config=config,
                         scope=scope if in_process_set else None,
                         process_set=process_set if in_process_set else hvd.global_process_set,
                         global_fragments=fragments, quickens=quickens)
    step_sync.sensed = None if sensed is None else sensed.to_dict()  # what topology="auto" found, and its cost
    options = {"op": str(op), "gradient_predivide_factor": gradient_predivide_factor,
               "sparse_as_dense": sparse_as_dense, "average_non_trainable": config.average_buffers,
               "optimizer": type(optimizer).__name__, "backward_passes_per_step": backward_passes_per_step,
               "average_aggregated_gradients": average_aggregated_gradients, "sparse_average": config.sparse_average,
               "overlap": bool(config.overlap),
               "scale_local_gradients": bool(scale_local_gradients)}
    # The set's size for scale_local_gradients is read from the plan at trace time (elastic worlds change).
    return _optimizer_class(optimizer, _DSSyncOptimizer).wrapping(
        optimizer, (process_set, None, backward_passes_per_step, average_aggregated_gradients, scale_local_gradients),
        sync=step_sync, model=model, options=options)
