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
import math
import threading
import time
import weakref

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..plan import (BSP, GLOBAL, GROUP, LOCAL, Action, SyncPlan, agreement_fields, agreement_payload,
                    arguments_for_world, check_agreement, resolve_schedule, ring_allreduce_bytes)
from ..process_sets import elastic_job, registry_for
from ..scope import Scope, acquire_registered
from ..sparse import RowSets, allgather_bytes, average_densely, id_dtype, pack_rows, unpack_unions
from ..watchdog import describe_wait, drain_at_exit, exit_timeout, process_watchdog

__all__ = ["StepSync", "ModelAverager", "make_plan"]

# Branches of the step's switch: no model averaging (a bulk-synchronous step, or a group of one),
# the average over all ranks, then one branch per distinct group of this rank.
_KEEP, _GLOBAL, _FIRST_GROUP = 0, 1, 2

# Every StepSync of this process, for the exit-time drain (see _drain_before_shutdown).
_live = weakref.WeakSet()
_exit = {"drain_registered": False}

# Numbers the StepSync objects of this process: every rank builds them in the same order (their process
# sets are registered collectively), so two optimizers in one step never share a Horovod op name.
_instances = itertools.count()

# The step travels with every average as its low bits, 0 or 1 in the averaged dtype (exact even in float16
# for any group of fewer than 2048 ranks): a bit's group mean is 0 or 1 only if every member has it alike.
_STEP_BITS = 32


def make_plan(num_groups=None, group_size=None, seed=0, schedule=None, topology=None, warmup_steps=0,
              global_every=0, average_every=1, schedule_options=None, scope=None, adaptive=None):
    """The :class:`SyncPlan` of this rank; the schedule must keep its groups for the whole run.

    The pool of process sets a traced graph can use is fixed when it is traced, so a schedule with
    windows is refused ("topology" with ``rotate_every``, for example). With
    ``scope`` (a :class:`hvd_dssync.scope.Scope` of a process set) the plan is that of this rank's position
    in the set.
    """
    if scope is not None and (topology is not None or schedule == "topology"):
        raise ValueError("Arg ``process_set``: schedule='topology' and ``topology`` are not supported inside a "
                         "process set (finding the hosts is a collective over all ranks); use 'shuffle' or "
                         "'butterfly'.")
    if isinstance(topology, str) and topology == "auto":  # sensed (once per job), or None for one rack
        from .functions import default_topology
        topology = default_topology(schedule, num_groups, group_size, topology, schedule_options, scope is None)[0]
    options = dict(schedule_options or {})
    schedule, num_groups, group_size = resolve_schedule(schedule, num_groups, group_size, topology)
    if topology is not None or schedule == "topology":
        from .functions import job_topology
        topology = job_topology(topology)
    rank, size = (hvd.rank(), hvd.size()) if scope is None else (scope.rank, scope.world_size)
    plan = SyncPlan(rank, size, schedule=schedule, num_groups=num_groups, group_size=group_size,
                    seed=seed, topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                    average_every=average_every, schedule_options=options, adaptive=adaptive)
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
                 sparse_as_dense=False, device_dense="", name="DSSync", arguments=None, scope=None,
                 process_set=hvd.global_process_set):
        self.compression = compression
        # Inside a process set: the set's ranks, by position (see hvd_dssync.scope); else the whole job.
        self._scope = scope
        self.process_set = process_set
        # Lossy compression's shared reference per variable, and whether it was set (see _average_differences).
        self._references, self._reference_set = {}, None
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.device_dense = device_dense
        self.arguments = arguments
        self._registry = registry_for(hvd)
        self._watchdog = process_watchdog(hvd.shutdown)
        self._open, self._opened = {}, itertools.count()
        self.sync_seconds = 0.0  # wall time this rank spent in its averages, as seen from Python
        self.decisions = []  # the adaptive policy's decisions, as dicts (see adapt)
        # Sparse averaging of embedding tables (see use_row_sets): the tables, in order, and their row sets.
        self._row_tables, self.row_sets = [], None
        self._row_checks = 0  # runs of the step whose equality check ran (see start_rows)
        self.sparse_bytes = 0  # bytes sent by averages that moved rows (see _average_rows)
        self._window = None  # under the adaptive policy: the branches of the window in force, a variable
        self._generation = None  # the registry's generation when this rank last connected; None: not yet
        # Set once this process's step has taken rank 0's counter (:meth:`adopt_root_step`). A variable,
        # for the traced step to read; outside any Keras or tf.Module tracking, so never saved.
        # Created here, eagerly: a variable created while a tf.function is traced makes it trace again.
        with tf.init_scope():
            self._adopted = tf.Variable(False, trainable=False, name="dssync_step_adopted")
        self._use(plan)
        # Kept for the life of this object, through changes of world: a newcomer builds its StepSync
        # fresh, and its op names must equal the survivors'.
        self.name = f"{name}_{next(_instances)}"
        _watch_until_exit(self)

    def _use(self, plan):
        self.plan = plan
        if self._in_process_set():
            # Before this object takes its op-name number: a refused set must not shift the later ones'.
            acquire_registered(hvd, self._scope, plan.schedule.window_groups(0), "hvd_dssync.keras")
        else:
            self._scope = Scope(tuple(range(plan.world_size)), plan.rank)
        self._groups = tuple(sorted({g for p in plan.schedule.partitions(0) for g in p
                                     if plan.rank in g and 1 < len(g) < plan.world_size}))
        self._table = self._branch_table()
        if plan.adaptive is not None:
            with tf.init_scope():
                if self._window is None:
                    self._window = tf.Variable(self._table, trainable=False, name="dssync_adaptive_window")
                else:
                    self._window.assign(self._table)

    def connect(self, what, parameters=None, options=None):
        """Check that all ranks were configured alike, then register the process sets (collectives).

        Every rank raises the same ``ValueError`` on a mismatch, before any process set is added.
        """
        mine = agreement_payload(agreement_fields(self.plan, parameters, options))
        generation = self._registry.refresh()
        gathered = hvd.allgather(tf.constant(mine), name=f"{self.name}_agreement", process_set=self.process_set)
        check_agreement(gathered.numpy(), what=what)
        if self.plan.world_size > 1 and not self._in_process_set():
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
            if self._generation is not None or (not self._in_process_set() and
                                                (self.plan.world_size, self.plan.rank) != (hvd.size(), hvd.rank())):
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
        if self._reference_set is not None:
            self._reference_set.assign(False)
        if self.row_sets is not None:  # the next runs check again whether the tables are equal
            self.row_sets.fill()
            self._row_checks = 0

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

    def adopt_root_step(self, counter):
        """An op that, on this process's first run of the step, sets ``counter`` (a step variable) to rank 0's.

        Horovod's resume recipe restores a checkpoint on rank 0 only and broadcasts after the first batch
        (``BroadcastGlobalVariablesCallback``), so the first step would otherwise start rank 0 at its saved
        step and the others at 0: different groups, a deadlock. One broadcast of a scalar, once per
        process; later runs read a flag. Under elastic Horovod the state's sync does it instead (a
        newcomer's first step is not the survivors').
        """
        if self.plan.world_size == 1 or elastic_job():
            return tf.no_op()

        def adopt():
            root = hvd.broadcast(tf.identity(counter), root_rank=self._scope.ranks[0], ignore_name_scope=True,
                                 name=f"{self.name}_root_step", process_set=self.process_set)
            with tf.control_dependencies([counter.assign(root)]):
                return tf.identity(self._adopted.assign(True))

        return tf.cond(self._adopted.read_value(), lambda: tf.constant(True), adopt)

    def shared_finiteness(self, grads):
        """``grads``, with the first one made NaN on every rank if any rank's are not all finite; and whether all were.

        A loss-scale optimizer skips the update, and so DS-Sync's average, on a rank whose gradients
        overflowed; its group would wait for it. Horovod's allreduced gradients carry one rank's overflow to
        all; here one scalar allreduce over all ranks does, so every rank skips together.
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        if self.plan.world_size == 1 or not present:
            return list(grads), tf.constant(True)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_dense_values(grads[i]))) for i in present])
        with tf.control_dependencies(self.world_check()):
            overflowed = tf.cast(tf.logical_not(finite), tf.float32)[None]
        everywhere = tf.equal(hvd.allreduce(overflowed, op=hvd.Sum, ignore_name_scope=True,
                                            name=f"{self.name}_finite", process_set=self.process_set)[0], 0.0)
        first = grads[present[0]]

        def poisoned():
            if isinstance(first, tf.IndexedSlices):
                return tf.IndexedSlices(first.values * np.nan, first.indices, first.dense_shape)
            return first * np.nan

        out = list(grads)
        out[present[0]] = tf.cond(everywhere, lambda: tf.identity(first), poisoned)
        return out, everywhere

    def _step_check(self, means, step, group_size):
        """An assertion that every member of the group that averaged ``means`` (step bits) is at ``step``.

        Op names do not carry the step, so a rank a step behind would otherwise average silently with
        the peers of another step whenever its group recurs; every member sees the same means, so all
        stop together.
        """
        means = tf.cast(means, tf.float64)
        spread = tf.reduce_max(tf.minimum(means, 1.0 - means))
        group_mean = tf.reduce_sum(means * tf.constant([2.0 ** i for i in range(_STEP_BITS)], tf.float64))
        # A bit that differs between members has a group mean of at least 1/size from 0 and from 1.
        agree = spread < 0.5 / self.plan.world_size
        return tf.debugging.Assert(
            agree, [f"hvd_dssync: ranks are at different DS-Sync steps: rank {self.plan.rank} is at step",
                    tf.cast(step, tf.int64), "while the members of its group (size", group_size,
                    ") average to step", group_mean, "(every member must be at the same step; a rank that "
                    "restored another checkpoint, or ran a step the others did not, differs)"],
            summarize=_STEP_BITS, name=f"{self.name}_step_check")

    def _branch_of(self, step, action=None):
        action = action or self.plan.action(step)
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
        start = policy.warmup_steps
        if self.plan.adaptive is not None:
            return self._window_table(start)
        period = policy.period() * len(schedule.partitions(0))
        return np.array([self._branch_of(start + i) for i in range(period)], dtype=np.int32)

    def _window_table(self, start):
        """The adaptive policy's branches for the window that starts at ``start``, from its decision in force."""
        actions = [(kind, self.plan.schedule.group_of(self.plan.rank, at) if kind == GROUP else self.plan.world)
                   for kind, at in self.plan.adaptive.planned(start)]
        return np.array([self._branch_of(None, Action(*a)) for a in actions], dtype=np.int32)

    def adapt(self, step, seconds, compute_seconds):
        """Note step ``step``'s figures under the adaptive policy; at a decision step, decide and set the next
        window's branches. Call it on every rank after each step (``SyncStatsCallback`` does), before the
        next: a decision step gathers every rank's figures (one small allgather, eager; the traced step's
        averages cannot carry them as the PyTorch adapter's do). Returns the
        decision's dict at a decision step, else None.
        """
        adaptive = self.plan.adaptive
        kind = adaptive.action(step)
        decision = adaptive.end_step(step, kind, seconds if kind in (GLOBAL, GROUP) else math.nan, compute_seconds,
                                     gather=self._gather_figures)
        if decision is not None:
            decision = decision.as_dict()
            self.decisions.append(decision)
        if adaptive.is_window_end(step):  # the next window's branches (a probe window's differ)
            self._window.assign(self._window_table(step + 1))
        return decision

    def _gather_figures(self, figures):
        return hvd.allgather(tf.constant(figures), name=f"{self.name}_adaptive", process_set=self.process_set).numpy()

    def branch(self, step):
        """The switch branch of ``step`` (an integer tensor), computed in the graph."""
        step = tf.cast(step, tf.int64)
        warmup = self.plan.policy.warmup_steps
        offset = tf.math.floormod(tf.maximum(step - warmup, 0), len(self._table))
        table = tf.constant(self._table) if self._window is None else self._window.read_value()
        branch = tf.gather(table, offset)
        if warmup:
            branch = tf.where(step < warmup, tf.constant(_KEEP, tf.int32), branch)
        return branch

    def gradients(self, grads, step):
        """``grads`` averaged over all ranks in a bulk-synchronous (warm-up) step, else unchanged.

        ``None`` entries stay ``None``; sparse gradients need ``sparse_as_dense`` during the warm-up.
        """
        if self.plan.policy.warmup_steps == 0 or self.plan.world_size == 1:
            return list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        with tf.control_dependencies(self.world_check()):
            dense = [tf.identity(self._dense(grads[i])) for i in present]
        bits = _step_bits(step, dense[0].dtype)

        def allreduce():
            reduced = self._allreduce_dense(dense + [bits], "bsp")
            if self.op == hvd.Sum:
                reduced[-1] = reduced[-1] / self.plan.world_size
            return reduced

        bsp = tf.cast(step, tf.int64) < self.plan.policy.warmup_steps
        begun = self._begin(tf.where(bsp, _GLOBAL, _KEEP), step, "bsp")
        with tf.control_dependencies([begun]):
            dense = [tf.identity(g) for g in dense]
        *reduced, means = tf.cond(bsp, allreduce, lambda: [tf.identity(g) for g in dense] + [bits])
        with tf.control_dependencies(reduced + [means]):
            ended = self._end(begun)
        with tf.control_dependencies([ended]):
            checked = self._step_check(means, step, self.plan.world_size)
        with tf.control_dependencies([checked]):
            reduced = [tf.identity(g) for g in reduced]
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        return out

    def allreduce_gradients(self, grads):
        """``grads`` reduced over all ranks as in a warm-up step, at any step (``None`` entries stay ``None``)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        if self.plan.world_size == 1 or not present:
            return list(grads)
        with tf.control_dependencies(self.world_check()):
            dense = [tf.identity(self._dense(grads[i])) for i in present]
        out = list(grads)
        for i, g in zip(present, self._allreduce_dense(dense, "allreduce_grads")):
            out[i] = g
        return out

    def _dense(self, gradient):
        if isinstance(gradient, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError("sparse gradients need sparse_as_dense=True to be allreduced by hvd_dssync")
            return tf.convert_to_tensor(gradient)
        return gradient

    def _allreduce_dense(self, dense, kind):
        """Horovod's gradient allreduce over all ranks: ``op``, ``compression``, ``gradient_predivide_factor``."""
        prescale = postscale = 1.0
        if self.op == hvd.Average and self.gradient_predivide_factor != 1.0:
            prescale = 1.0 / self.gradient_predivide_factor
            postscale = self.gradient_predivide_factor
        return hvd.grouped_allreduce(dense, op=self.op, compression=self.compression,
                                     prescale_factor=prescale, postscale_factor=postscale,
                                     device_dense=self.device_dense, ignore_name_scope=True,
                                     name=f"{self.name}_{kind}", process_set=self.process_set)

    def average(self, variables, step):
        """Assign to ``variables`` their average inside this rank's group at ``step`` (a tensor)."""
        variables = list(variables)
        check = self.world_check()
        if self.plan.world_size == 1 or not variables or not self._table.any():
            return tf.group(*check)
        branch = self.branch(step)
        begun = self._begin(branch, step, "group")
        by_rows = self._row_positions() if self.compression is hvd.Compression.none else {}
        with tf.control_dependencies(check + [begun]):
            # Tables averaged by their rows are not read whole: a live read would make their row update copy
            # the whole table first (copy-on-write).
            values = [None if v.ref() in by_rows else tf.identity(v) for v in variables]
        bits = _step_bits(step, variables[0].dtype)
        writes = []  # (table, rows' indices, averaged rows) of the tables averaged by their rows
        if self.compression is not hvd.Compression.none:
            *averaged, means = self._average_differences(variables, values, bits, branch, step)
        elif any(v.ref() in by_rows for v in variables):
            with tf.control_dependencies(check + [begun]):
                variables, averaged, writes, means = self._average_rows(variables, values, bits, branch)
        else:
            sent = values + [bits]
            branches = [lambda: [tf.identity(v) for v in sent],
                        lambda: self._allreduce(sent, self.process_set, "global")]
            for group in self._groups:
                branches.append(lambda g=group: self._allreduce(sent, self._set_of(g), "group"))
            *averaged, means = tf.switch_case(branch, branches, name=f"{self.name}_switch")
        with tf.control_dependencies(averaged + [means] + [rows for _, _, rows in writes]):
            ended = self._end(begun)
        sizes = tf.constant([1, self.plan.world_size] + [len(g) for g in self._groups], tf.int32)
        with tf.control_dependencies([ended]):
            checked = self._step_check(means, step, tf.gather(sizes, branch))
        with tf.control_dependencies([checked]):
            return tf.group(*[v.assign(a) for v, a in zip(variables, averaged)],
                            *[table.scatter_update(tf.IndexedSlices(rows, index)) for table, index, rows in writes])

    # --- sparse averaging of embedding tables (hvd_dssync.sparse) -----------------------------

    def use_row_sets(self, tables):
        """Average the embedding ``tables`` (variables whose gradients are sparse) over the rows that may differ.

        Called when the step is traced, with the same tables in the same order on every rank. The row sets
        (:class:`hvd_dssync.sparse.RowSets`, kept in Python) start full, the safe superset, until
        :meth:`start_rows` finds the tables equal on every rank.
        """
        tables = list(tables)
        if [t.ref() for t in tables] == [t.ref() for t in self._row_tables]:
            return
        self._row_tables = tables
        self.row_sets = RowSets({f"{k}:{t.name}": int(t.shape[0]) for k, t in enumerate(tables)}) if tables else None
        self._row_checks = 0
        if self.row_sets is not None:
            self.row_sets.fill()

    def _row_positions(self):
        return {t.ref(): k for k, t in enumerate(self._row_tables)}

    def start_rows(self, first_pass):
        """An op for the start of a step, before its update: in the first two steps this process runs, if the
        tables are equal on every rank, no row may differ: the row sets empty. Else they stay as they are
        (full from :meth:`use_row_sets`, the safe superset, or what the steps since made of them).

        One small allreduce of the tables' fingerprints, in those two steps only. Two, because Horovod's Keras
        recipe broadcasts the variables after the first batch: ranks that started from different models are
        equal at the second step. A resumed job whose ranks load their own models keeps full sets.
        ``first_pass``: a boolean tensor, False for passes that continue a step (``backward_passes_per_step``).
        """
        if self.row_sets is None:
            return tf.no_op()

        def due(first):
            return np.bool_(bool(first) and self._row_checks < 2)

        def checked(equal):
            self._row_checks += 1
            if equal:
                self.row_sets.clear()
            return np.bool_(equal)

        def check():
            fingerprints = tf.concat([_fingerprint(t) for t in self._row_tables], 0)
            extremes = hvd.allreduce(tf.concat([fingerprints, -fingerprints], 0), op=hvd.Max, ignore_name_scope=True,
                                     name=f"{self.name}_rows_equal", process_set=self.process_set)
            n = len(self._row_tables) * 2
            equal = tf.reduce_all(tf.equal(extremes[:n], -extremes[n:]))  # the largest equals the smallest
            return tf.numpy_function(checked, [equal], tf.bool, stateful=True, name=f"{self.name}_rows_checked")

        need = tf.numpy_function(due, [first_pass], tf.bool, stateful=True, name=f"{self.name}_rows_due")
        need.set_shape([])
        return tf.cond(need, check, lambda: tf.constant(False))

    def touch_rows(self, indices):
        """An op adding to the row sets the rows this rank's update may change: ``indices[k]``, the rows of the
        ``k``-th table's sparse gradient (an ``IndexedSlices``' indices)."""
        if self.row_sets is None:
            return tf.no_op()
        names = list(self.row_sets.tables)

        def touch(*rows):
            for name, r in zip(names, rows):
                self.row_sets.touch(name, r)
            return np.bool_(True)

        return tf.numpy_function(touch, [tf.cast(i, tf.int64) for i in indices], tf.bool, stateful=True,
                                 name=f"{self.name}_touch_rows")

    def forget_row_sets(self):
        """After an exact average and broadcast over every rank (``synchronize_models``): no row may differ."""
        if self.row_sets is not None:
            self.row_sets.clear()

    def _average_rows(self, variables, values, bits, branch):
        """The switch of :meth:`average` with embedding tables averaged over the rows of the group's union.

        A communicating branch gathers the members' row sets (one allgather of ids), every member adopts
        the union (a global average empties the sets), and one grouped allreduce averages the dense
        variables and the union's rows of each table (its whole table when that is cheaper, see
        :func:`hvd_dssync.sparse.average_densely`). Returns the dense variables with their averages, the
        ``(table, indices, rows)`` to write, and the step bits' means. ``values`` holds the dense variables'
        values (None for the tables, whose rows are gathered from the variables).
        """
        positions = self._row_positions()
        tables = sorted((i for i, v in enumerate(variables) if v.ref() in positions),
                        key=lambda i: positions[variables[i].ref()])
        if len(tables) != len(self._row_tables):
            raise ValueError("hvd_dssync: the averaged variables leave out some of the embedding tables averaged "
                             "by their rows; average all of them or none.")
        dense = [i for i in range(len(variables)) if i not in tables]
        dense_bytes = sum(values[i].shape.num_elements() * values[i].dtype.size for i in dense)
        row_bytes = [variables[i].shape[1:].num_elements() * variables[i].dtype.size for i in tables]
        ids = id_dtype(self.row_sets.tables)

        def unite(gathered, size, is_global):
            unions = unpack_unions(gathered, self.row_sets.tables)
            out = []
            for name, rows in self.row_sets.tables.items():
                union = unions[name]
                if len(union) == 0:
                    union = np.zeros(1, np.int64)  # one row all the same: a collective of fixed arity
                if not is_global:
                    self.row_sets.adopt(name, union)
                out.append(np.arange(rows, dtype=np.int64) if average_densely(len(union), rows) else union)
            if is_global:
                self.row_sets.clear()
            moved = dense_bytes + sum(len(index) * b for index, b in zip(out, row_bytes))
            self.sparse_bytes += ring_allreduce_bytes(int(size), moved) + allgather_bytes(int(size), gathered.nbytes)
            return out

        def keep():
            return ([tf.identity(values[i]) for i in dense]
                    + [tf.zeros([0, *variables[i].shape[1:]], variables[i].dtype) for i in tables]
                    + [tf.zeros([0], tf.int64) for _ in tables] + [tf.identity(bits)])

        def through(process_set, kind, size, is_global):
            def run():
                prefix = f"{self.name}_{kind}_{process_set.process_set_id}"
                mine = tf.numpy_function(lambda: pack_rows(self.row_sets), [], tf.as_dtype(ids), stateful=True,
                                         name=f"{prefix}_pack")
                mine.set_shape([None])
                gathered = hvd.allgather(mine, name=f"{prefix}_rows", ignore_name_scope=True, process_set=process_set)
                indices = tf.numpy_function(lambda g: unite(g, size, is_global), [gathered], [tf.int64] * len(tables),
                                            stateful=True, name=f"{prefix}_unite")
                for index in indices:
                    index.set_shape([None])
                rows = [tf.gather(variables[i], index) for i, index in zip(tables, indices)]
                *averaged, means = self._allreduce([values[i] for i in dense] + rows + [bits], process_set, kind)
                return averaged + list(indices) + [means]
            return run

        branches = [keep, through(self.process_set, "global", self.plan.world_size, True)]
        for group in self._groups:
            branches.append(through(self._set_of(group), "group", len(group), False))
        out = tf.switch_case(branch, branches, name=f"{self.name}_switch")
        n, k = len(dense), len(tables)
        writes = [(variables[i], out[n + k + j], out[n + j]) for j, i in enumerate(tables)]
        return [variables[i] for i in dense], out[:n], writes, out[-1]

    def _begin(self, branch, step, kind):
        """An op that opens this step's communication when ``branch`` communicates; returns its id tensor.

        In Python, once per step: it notes the time (``sync_seconds`` adds up the communication) and arms
        the process's watchdog (see :mod:`hvd_dssync.watchdog`), naming the group, which is resolved here
        at trace time. :meth:`_end` closes it.
        """
        rank, world = hvd.rank(), self._scope.ranks
        groups = {_GLOBAL: world, **{_FIRST_GROUP + i: self._scope.to_global(g) for i, g in enumerate(self._groups)}}

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

    def _in_process_set(self):
        return self.process_set is not hvd.global_process_set

    def _set_of(self, group):
        """The Horovod process set of ``group`` (positions in the scope)."""
        return self._registry.get(self._scope.to_global(group))

    def _reference_of(self, variable):
        key = variable.ref()
        if key not in self._references:
            with tf.init_scope():
                if self._reference_set is None:
                    self._reference_set = tf.Variable(False, trainable=False, name="dssync_reference_set")
                self._references[key] = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                                    name="dssync_reference")
        return self._references[key]

    def _average_differences(self, variables, values, bits, branch, step):
        """Lossy compression: the group's models averaged through compressed differences from a shared reference.

        As the PyTorch adapter's (``hvd_dssync.torch.optimizer``): rank ``j`` sends ``C(x_j - r)`` and keeps
        ``r + mean_k C(x_k - r) + (x_j - r - C(x_j - r))``, so the group's mean is kept and an update below
        the compression's resolution is carried, not rounded away. ``r`` is set by an exact average over the
        scope at the first step after the warm-up (the same step on every rank, whatever its group) and
        moved by global averages only. The step ``bits`` ride along uncompressed; their means come last.
        """
        references = [self._reference_of(v) for v in variables]
        compression = self.compression

        def establish():
            *exact, means = hvd.grouped_allreduce(values + [bits], op=hvd.Average, process_set=self.process_set,
                                                  device_dense=self.device_dense, ignore_name_scope=True,
                                                  name=f"{self.name}_reference")
            with tf.control_dependencies([r.assign(e) for r, e in zip(references, exact)]
                                         + [self._reference_set.assign(True)]):
                return [tf.identity(e) for e in exact] + [tf.identity(means)]

        def through(process_set, kind, moves_reference):
            def mix():
                differences = [v - r for v, r in zip(values, references)]
                compressed, contexts = zip(*(compression.compress(d) for d in differences))
                # TF's grouped allreduce takes one dtype; 0 and 1 and their means are exact enough in any float.
                *averaged, means = hvd.grouped_allreduce(list(compressed) + [tf.cast(bits, compressed[0].dtype)],
                                                         op=hvd.Average,
                                                         process_set=process_set, device_dense=self.device_dense,
                                                         ignore_name_scope=True,
                                                         name=f"{self.name}_{kind}_{process_set.process_set_id}")
                means = tf.cast(means, bits.dtype)
                received = [compression.decompress(a, ctx) for a, ctx in zip(averaged, contexts)]
                mixed = [r + a + (d - compression.decompress(c, ctx))
                         for r, a, d, c, ctx in zip(references, received, differences, compressed, contexts)]
                if not moves_reference:
                    return mixed + [means]
                with tf.control_dependencies(mixed):
                    moved = [r.assign_add(a) for r, a in zip(references, received)]
                with tf.control_dependencies(moved):
                    return [tf.identity(m) for m in mixed] + [tf.identity(means)]
            return mix

        branches = [lambda: [tf.identity(v) for v in values] + [tf.identity(bits)],
                    through(self.process_set, "global", True)]
        for group in self._groups:
            branches.append(through(self._set_of(group), "group", False))
        first = tf.logical_and(tf.logical_not(self._reference_set),
                               tf.cast(step, tf.int64) >= self.plan.policy.warmup_steps)
        return tf.cond(first, establish, lambda: tf.switch_case(branch, branches, name=f"{self.name}_switch"))

    def _allreduce(self, values, process_set, kind):
        return hvd.grouped_allreduce(values, op=hvd.Average, compression=self.compression,
                                     process_set=process_set, device_dense=self.device_dense,
                                     ignore_name_scope=True,
                                     name=f"{self.name}_{kind}_{process_set.process_set_id}")


def _watch_until_exit(sync):
    """Track ``sync``; once per process, arrange a drain before Horovod's own exit-time shutdown.

    Registered after ``hvd.init()`` (which registers Horovod's shutdown), so it runs first.
    """
    _live.add(sync)
    if _exit["drain_registered"]:
        return
    _exit["drain_registered"] = True
    drain_at_exit(_drain_before_shutdown)


def _drain_before_shutdown():
    """Let every rank finish its last group average before any rank shuts Horovod down (as the PyTorch adapter).

    The groups of the last step finish at different times; a rank that exits and shuts Horovod down while
    another group still averages makes that group's step fail. So a script that ends without a global
    collective gets one here: an allreduce over each DS-Sync process set, waited for at most
    ``HVD_DSSYNC_EXIT_TIMEOUT`` seconds (default 30), so that a rank whose peers are stuck or gone still
    exits. Skipped after an uncaught exception (:func:`hvd_dssync.watchdog.drain_at_exit`).
    """
    if not hvd.is_initialized():
        return
    process_sets = {id(s.process_set): s.process_set for s in list(_live)}

    def drain():
        try:
            for process_set in process_sets.values():
                hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name=f"DSSync_exit_{process_set.process_set_id}",
                              process_set=process_set)
        except Exception:  # Horovod already shut down by a failing peer: nothing left to drain
            pass

    # Horovod's eager op cannot be given a deadline; a daemon thread waiting for it can be left behind.
    waiter = threading.Thread(target=drain, name="hvd_dssync-exit-drain", daemon=True)
    waiter.start()
    waiter.join(exit_timeout())


def _step_bits(step, dtype):
    """The low bits of ``step`` as 0 and 1 in ``dtype``: :meth:`StepSync._step_check` reads their group mean."""
    shifts = tf.range(_STEP_BITS, dtype=tf.int64)
    return tf.cast(tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.cast(step, tf.int64), shifts), 1), dtype)


def _fingerprint(table):
    """Two float64 sums of ``table`` that equal tables share on every rank (same values, same arithmetic)."""
    x = tf.convert_to_tensor(table)
    x = tf.reshape(x, [x.shape[0], -1])
    mix = tf.cast(tf.range(x.shape[1]) % 7 + 1, x.dtype)
    weights = tf.cast(tf.range(x.shape[0]) % 65521 + 1, tf.float64)
    sums = tf.cast(tf.reduce_sum(x, 1), tf.float64)
    mixed = tf.cast(tf.reduce_sum(x * mix, 1), tf.float64)
    return tf.stack([tf.reduce_sum(sums * weights), tf.reduce_sum(mixed * tf.reverse(weights, [0]))])


def _dense_values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


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
        with tf.control_dependencies([self._sync.adopt_root_step(self.step)]):
            return self._sync.gradients(list(grads), self.step.read_value())

    def __call__(self, variables):
        """Average the floating-point ``variables`` inside this step's group, then count the step."""
        variables = [v for v in variables if v.dtype.is_floating]
        self._sync.ensure_connected("hvd_dssync.keras.ModelAverager", options=self._options)
        with tf.control_dependencies([self._sync.adopt_root_step(self.step)]):
            step = self.step.read_value()
        with tf.control_dependencies([self._sync.average(variables, step)]):
            return self.step.assign_add(1)
