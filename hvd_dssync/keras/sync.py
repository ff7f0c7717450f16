"""One DS-Sync step inside a TensorFlow graph, shared by the Keras optimizer and the custom-loop averager.

Horovod fixes an op's process set when a ``tf.function`` is traced, so the group cannot be picked in
Python at trace time. Instead the schedule's groups are registered as process sets once, up front; the
traced graph holds one branch per distinct group of this rank, and ``tf.switch_case`` picks the branch
from the step tensor at run time. The branch of every step comes from a table filled by
:meth:`SyncPlan.action` in Python, so the graph and the PyTorch adapter follow the same schedule and
policy code.

Elastic Horovod (``HOROVOD_ELASTIC=1``): a worker that joins builds its optimizer while the others are
inside ``hvd.elastic.run``'s state sync, so nothing communicates at construction; the agreement check and
the registration run eagerly (``tf.init_scope``) when the step is first traced, where every rank is at the
same point. After Horovod is re-initialized for a new world, the next trace rebuilds the plan for the new
world size (same arguments, same op names) and connects again; a graph traced for the old world fails
with a clear error instead of using process sets that no longer exist.
"""
import itertools
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..plan import (BSP, GLOBAL, LOCAL, SyncPlan, agreement_fields, agreement_payload, arguments_for_world,
                    check_agreement, resolve_schedule)
from ..process_sets import elastic_job, registry_for
from ..watchdog import describe_wait, process_watchdog

__all__ = ["StepSync", "ModelAverager", "make_plan"]

# Branches of the step's switch: no model averaging (a bulk-synchronous step, or a group of one),
# the average over all ranks, then one branch per distinct group of this rank.
_KEEP, _GLOBAL, _FIRST_GROUP = 0, 1, 2

# Numbers the StepSync objects of this process: every rank builds them in the same order (their process
# sets are registered collectively), so two optimizers in one step never share a Horovod op name.
_instances = itertools.count()


def make_plan(num_groups=None, group_size=None, seed=0, schedule=None, topology=None, warmup_steps=0,
              global_every=0, average_every=1, schedule_options=None):
    """The :class:`SyncPlan` of this rank; the schedule must keep its groups for the whole run.

    The pool of process sets a traced graph can use is fixed when it is traced, so a schedule with
    windows is refused; "topology" therefore defaults to fixed bridges (``rotate_every=None``).
    """
    options = dict(schedule_options or {})
    schedule, num_groups, group_size = resolve_schedule(schedule, num_groups, group_size, topology)
    if schedule == "topology":
        options.setdefault("rotate_every", None)
    if topology is not None or schedule == "topology":
        from .functions import job_topology
        topology = job_topology(topology)
    plan = SyncPlan(hvd.rank(), hvd.size(), schedule=schedule, num_groups=num_groups, group_size=group_size,
                    seed=seed, topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                    average_every=average_every, schedule_options=options)
    if plan.schedule.window_steps is not None:
        raise ValueError(
            f"hvd_dssync.keras: schedule {plan.schedule!r} changes its groups every "
            f"{plan.schedule.window_steps} steps (window_steps), but a traced graph keeps the process sets "
            "it was traced with. Use a schedule with one endless window (e.g. "
            "schedule_options={'window_steps': None} for 'shuffle', or 'butterfly').")
    return plan


class StepSync:
    """This rank's DS-Sync communication for a step given as a tensor; used inside ``tf.function``.

    :meth:`connect` checks that the ranks agree and registers the schedule's process sets (collectives:
    build and connect it on every rank, in the same order); :meth:`ensure_connected` does it once per
    Horovod world, at trace time, rebuilding the plan first if the world changed. :meth:`gradients`
    averages gradients over all ranks in bulk-synchronous steps; :meth:`average` averages variables inside
    the step's group (or over all ranks).

    ``arguments`` are :func:`make_plan`'s keyword arguments, kept to rebuild the plan for a new world.
    """

    def __init__(self, plan, compression=hvd.Compression.none, op=hvd.Average, gradient_predivide_factor=1.0,
                 sparse_as_dense=False, device_dense="", name="DSSync", arguments=None):
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.device_dense = device_dense
        self.arguments = arguments
        # Kept for the life of this object, through changes of world: a newcomer builds its StepSync
        # fresh, and its op names must equal the survivors'.
        self.name = f"{name}_{next(_instances)}"
        self._registry = registry_for(hvd)
        self._watchdog = process_watchdog(hvd.shutdown)
        self._open, self._opened = {}, itertools.count()
        self.sync_seconds = 0.0  # wall time this rank spent in its averages, as seen from Python
        self._generation = None  # the registry's generation when this rank last connected; None: not yet
        self._use(plan)

    def _use(self, plan):
        self.plan = plan
        self._groups = tuple(sorted({g for p in plan.schedule.partitions(0) for g in p
                                     if plan.rank in g and 1 < len(g) < plan.world_size}))
        self._table = self._branch_table()

    def connect(self, what, parameters=None, options=None):
        """Check that all ranks were configured alike, then register the process sets (collectives).

        Every rank raises the same ``ValueError`` on a mismatch, before any process set is added.
        """
        mine = agreement_payload(agreement_fields(self.plan, parameters, options))
        generation = self._registry.refresh()
        gathered = hvd.allgather(tf.constant(mine), name=f"{self.name}_agreement")
        check_agreement(gathered.numpy(), what=what)
        if self.plan.world_size > 1:
            acquire, _ = self.plan.window_change(0)
            self._registry.acquire(acquire)
        self._generation = generation

    def ensure_connected(self, what, parameters=None, options=None):
        """:meth:`connect` once per Horovod world; call it where every rank is at the same point.

        Runs eagerly even while a step is traced (``tf.init_scope``). Without communication it notices a
        re-initialized Horovod (the registry's generation) and rebuilds the plan for the new world first.
        """
        with tf.init_scope():
            generation = self._registry.refresh()
            if generation == self._generation:
                return
            if self._generation is not None or (self.plan.world_size, self.plan.rank) != (hvd.size(), hvd.rank()):
                self.rebuild()
            self.connect(what, parameters, options)

    def rebuild(self):
        """The plan of the current Horovod world, from the same arguments; keeps the op names. No communication.

        ``num_groups``/``group_size`` are capped at the new world size (:func:`arguments_for_world`); a
        schedule object or a topology raises a ``RuntimeError``. The next :meth:`ensure_connected` connects.
        """
        if self.plan.world_size == hvd.size() and self.plan.rank == hvd.rank() and self._generation is None:
            return
        if self.arguments is None:
            raise RuntimeError("hvd_dssync: the Horovod world changed, and this DS-Sync object was built without "
                               "its arguments, so it cannot rebuild its schedule.")
        self._use(make_plan(**arguments_for_world(self.arguments, hvd.size())))
        self._generation = None

    def world_check(self):
        """Under elastic Horovod, ops that fail if Horovod's world is no longer the one this was traced for.

        Horovod fixes the process sets of a traced graph; run in another world it would hang or average
        with the wrong ranks. Two scalar ops per step (``hvd.size_op``, ``hvd.rank_op``); none outside elastic.
        """
        if not elastic_job():
            return []
        size, rank = hvd.size_op(), hvd.rank_op()
        same = tf.logical_and(tf.equal(size, self.plan.world_size), tf.equal(rank, self.plan.rank))
        message = (f"hvd_dssync: this step was traced for a Horovod world of {self.plan.world_size} ranks "
                   f"(as rank {self.plan.rank}), but Horovod was re-initialized since (elastic reset); its "
                   "process sets are gone. Use hvd_dssync.keras.elastic.KerasState instead of "
                   "hvd.elastic.KerasState (it retraces the step), or set model.train_function = None in a "
                   "reset callback. Horovod's world size and this rank now:")
        return [tf.debugging.Assert(same, [message, size, rank], name=f"{self.name}_world_check")]

    def _branch_of(self, step):
        action = self.plan.action(step)
        if action.kind in (BSP, LOCAL) or len(action.group) == 1:
            return _KEEP
        if action.kind == GLOBAL or len(action.group) == self.plan.world_size:
            return _GLOBAL
        return _FIRST_GROUP + self._groups.index(action.group)

    def _branch_table(self):
        """Branches for the steps after warm-up, one period long: the policy and cycle repeat after it.

        The policy's kinds repeat every ``policy.period()`` steps, and the schedule advances a whole
        number of times in each, so ``period() * cycle`` steps bring both back to their start.
        """
        policy, schedule = self.plan.policy, self.plan.schedule
        period = policy.period() * len(schedule.partitions(0))
        start = policy.warmup_steps
        return np.array([self._branch_of(start + i) for i in range(period)], dtype=np.int32)

    def branch(self, step):
        """The switch branch of ``step`` (an integer tensor), computed in the graph."""
        step = tf.cast(step, tf.int64)
        warmup = self.plan.policy.warmup_steps
        offset = tf.math.floormod(tf.maximum(step - warmup, 0), len(self._table))
        branch = tf.gather(tf.constant(self._table), offset)
        if warmup:
            branch = tf.where(step < warmup, tf.constant(_KEEP, tf.int32), branch)
        return branch

    def gradients(self, grads, step):
        """``grads`` averaged over all ranks in a bulk-synchronous (warm-up) step, else unchanged.

        ``None`` entries stay ``None``; sparse gradients need ``sparse_as_dense`` during the warm-up.
        """
        if self.plan.policy.warmup_steps == 0 or self.plan.world_size == 1:
            return list(grads)
        check = self.world_check()
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = []
        for i in present:
            g = grads[i]
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError("sparse gradients need sparse_as_dense=True during hvd_dssync's warm-up")
                g = tf.convert_to_tensor(g)
            if check:
                with tf.control_dependencies(check):
                    g = tf.identity(g)
            dense.append(g)
        if not dense:
            return list(grads)
        prescale = postscale = 1.0
        if self.op == hvd.Average and self.gradient_predivide_factor != 1.0:
            prescale = 1.0 / self.gradient_predivide_factor
            postscale = self.gradient_predivide_factor

        def allreduce():
            return hvd.grouped_allreduce(dense, op=self.op, compression=self.compression,
                                         prescale_factor=prescale, postscale_factor=postscale,
                                         device_dense=self.device_dense, ignore_name_scope=True,
                                         name=f"{self.name}_bsp")

        bsp = tf.cast(step, tf.int64) < self.plan.policy.warmup_steps
        begun = self._begin(tf.where(bsp, _GLOBAL, _KEEP), step, "bsp")
        with tf.control_dependencies([begun]):
            dense = [tf.identity(g) for g in dense]
        reduced = tf.cond(bsp, allreduce, lambda: [tf.identity(g) for g in dense])
        with tf.control_dependencies(reduced):
            ended = self._end(begun)
        with tf.control_dependencies([ended]):
            reduced = [tf.identity(g) for g in reduced]
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        return out

    def average(self, variables, step):
        """Assign to ``variables`` their average inside this rank's group at ``step`` (a tensor)."""
        variables = list(variables)
        check = self.world_check()
        if self.plan.world_size == 1 or not variables or not self._table.any():
            return tf.group(*check)
        branch = self.branch(step)
        begun = self._begin(branch, step, "group")
        with tf.control_dependencies(check + [begun]):
            values = [tf.identity(v) for v in variables]
        branches = [lambda: [tf.identity(v) for v in values],
                    lambda: self._allreduce(values, hvd.global_process_set, "global")]
        for group in self._groups:
            branches.append(lambda g=group: self._allreduce(values, self._registry.get(g), "group"))
        averaged = tf.switch_case(branch, branches, name=f"{self.name}_switch")
        with tf.control_dependencies([v.assign(a) for v, a in zip(variables, averaged)]):
            return self._end(begun)

    def _begin(self, branch, step, kind):
        """An op that opens this step's communication when ``branch`` communicates; returns its id tensor.

        In Python, once per step: it notes the time (``sync_seconds`` adds up the communication) and arms
        the process's watchdog (see :mod:`hvd_dssync.watchdog`), naming the group, which is resolved here
        at trace time. :meth:`_end` closes it.
        """
        rank, world = self.plan.rank, tuple(range(self.plan.world_size))
        groups = {_GLOBAL: world, **{_FIRST_GROUP + i: g for i, g in enumerate(self._groups)}}

        def begin(branch, step):
            group = groups.get(int(branch))
            if group is None:
                return np.int64(-1)
            kind_now = "global" if kind == "group" and group == world else kind
            token = self._watchdog.arm(describe_wait(rank, group, int(step), kind_now))
            opened = next(self._opened)
            self._open[opened] = (time.perf_counter(), token)
            return np.int64(opened)

        return tf.numpy_function(begin, [branch, tf.cast(step, tf.int64)], tf.int64, stateful=True,
                                 name=f"{self.name}_begin")

    def _end(self, opened):
        def end(opened):
            if opened >= 0:
                started, token = self._open.pop(int(opened))
                self._watchdog.disarm(token)
                self.sync_seconds += time.perf_counter() - started
            return np.int64(0)

        return tf.numpy_function(end, [opened], tf.int64, stateful=True, name=f"{self.name}_end")

    def _allreduce(self, values, process_set, kind):
        return hvd.grouped_allreduce(values, op=hvd.Average, compression=self.compression,
                                     process_set=process_set, device_dense=self.device_dense,
                                     ignore_name_scope=True,
                                     name=f"{self.name}_{kind}_{process_set.process_set_id}")


class ModelAverager(tf.Module):
    """DS-Sync for TF2 custom loops: average variables inside the step's group, in or out of ``tf.function``.

    For users of ``hvd.DistributedGradientTape``: keep a plain ``tf.GradientTape`` (each rank steps on
    its own gradient), apply the gradients, then call the averager on the model's variables. It keeps
    its own step counter (saved with ``tf.train.Checkpoint``), so the groups change from call to call
    inside one traced function. In warm-up steps (``warmup_steps``) call :meth:`gradients` before
    applying them, as with Horovod's tape; outside the warm-up it returns them unchanged.

    Args (keyword-only): as :func:`hvd_dssync.keras.DistributedOptimizer`'s DS-Sync arguments, plus
        ``compression`` for the averaged tensors and ``name`` for the Horovod ops (unique per averager).

    Example::

        averager = dss.ModelAverager(num_groups=2, seed=0)

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = averager.gradients(tape.gradient(loss, model.trainable_variables))
            opt.apply_gradients(zip(grads, model.trainable_variables))
            averager(model.variables)
            return loss
    """

    def __init__(self, *, num_groups=None, group_size=None, seed=0, schedule=None, topology=None,
                 warmup_steps=0, global_every=0, average_every=1, schedule_options=None,
                 compression=hvd.Compression.none,
                 name="DSSyncAverager"):
        super().__init__(name=name)
        arguments = dict(num_groups=num_groups, group_size=group_size, seed=seed, schedule=schedule,
                         topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                         average_every=average_every, schedule_options=schedule_options)
        self._sync = StepSync(make_plan(**arguments), compression=compression, name=name, arguments=arguments)
        self._options = {"compression": type(compression).__name__}
        if not elastic_job():  # under elastic Horovod, at the first trace instead (see the module's docstring)
            self._sync.connect("hvd_dssync.keras.ModelAverager", options=self._options)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    @property
    def schedule(self):
        return self._sync.plan.schedule

    @property
    def policy(self):
        return self._sync.plan.policy

    def gradients(self, grads):
        """The gradients averaged over all ranks in a warm-up step, else unchanged."""
        self._sync.ensure_connected("hvd_dssync.keras.ModelAverager", options=self._options)
        return self._sync.gradients(list(grads), self.step)

    def __call__(self, variables):
        """Average the floating-point ``variables`` inside this step's group, then count the step."""
        variables = [v for v in variables if v.dtype.is_floating]
        self._sync.ensure_connected("hvd_dssync.keras.ModelAverager", options=self._options)
        step = self.step.read_value()
        with tf.control_dependencies([self._sync.average(variables, step)]):
            return self.step.assign_add(1)
