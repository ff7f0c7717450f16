"""One DS-Sync step inside a TensorFlow graph, shared by the Keras optimizer and the custom-loop averager.

Horovod fixes an op's process set when a ``tf.function`` is traced, so the group cannot be picked in
Python at trace time. Instead the schedule's groups are registered as process sets once, up front; the
traced graph holds one branch per distinct group of this rank, and ``tf.switch_case`` picks the branch
from the step tensor at run time. The branch of every step comes from a table filled by
:meth:`SyncPlan.action` in Python, so the graph and the PyTorch adapter follow the same schedule and
policy code.

:class:`StepSync` holds the plan, its process sets and the step's switch (:class:`.switch.Switch`, made
anew with each plan), and builds the parts with what each needs; they do one job each: the averages
(:mod:`.averaging`), the embedding tables' rows (:mod:`.sparse_rows`), the adaptive policy's window
(:mod:`.adaptive_step`), the step signature and the watchdog (:mod:`.step_guard`), the exit drain
(:mod:`.exit`). Its step methods (:meth:`StepSync.gradients`, :meth:`StepSync.average`,
:meth:`StepSync.adapt`) hand the parts the switch and the world check.

Elastic Horovod (``HOROVOD_ELASTIC=1``): a worker that joins builds its optimizer while the others are
inside ``hvd.elastic.run``'s state sync, so nothing communicates at construction; the agreement check and
the registration run eagerly (``tf.init_scope``) when the step is first traced, where every rank is at the
same point. After Horovod is re-initialized for a new world, the next trace rebuilds the plan for the new
world size (same arguments, same op names) and connects again; a graph traced for the old world fails
with a clear error instead of using process sets that no longer exist.
"""
import itertools
import logging

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..overlap import runs_trial
from ..plan import check_ranks_agree
from ..process_sets import elastic_job, registry_for
from ..scope import Scope, acquire_registered
from .adaptive_step import AdaptiveStep
from .averaging import Averaging, ExactAverage
from .exit import watch_until_exit
from .functions import allgather_job_rows
from .graph_plan import make_plan
from .overlap import InFlight
from .overlap_choice import OverlapChoice
from .sparse_rows import SparseRows
from .step_guard import StepGuard
from .switch import KEEP_BRANCH, Switch

__all__ = ["StepSync", "make_plan", "skip_instance"]

log = logging.getLogger("hvd_dssync")

# Numbers the StepSync objects of this process: every rank builds them in the same order (their process
# sets are registered collectively), so two optimizers in one step never share a Horovod op name.
_instances = itertools.count()


def skip_instance():
    """Take the next StepSync number without building one: a rank outside an optimizer's process set, whose
    set's ranks build one there, so that every rank's later StepSync objects keep the same op names."""
    next(_instances)


class StepSync:
    """This rank's DS-Sync communication for a step given as a tensor; used inside ``tf.function``.

    :meth:`connect` checks that the ranks agree and registers the schedule's process sets (collectives:
    build and connect it on every rank, in the same order); :meth:`ensure_connected` does it once per
    Horovod world, at trace time, rebuilding the plan first if the world changed. :meth:`gradients`
    averages gradients over all ranks in bulk-synchronous steps; :meth:`average` averages variables inside
    the step's group (or over all ranks).

    ``config`` is the :class:`hvd_dssync.config.SyncConfig` the plan was built from (:func:`make_plan`), kept
    to rebuild the plan for a new world; ``global_fragments``, in how many fragments ``overlap=True`` sends a
    global average (:func:`hvd_dssync.fragments.forced_fragments`).

    Example::

        config, _ = SyncConfig(num_groups=2, seed=0).resolve(default_topology, job_topology, routes=False)
        sync = StepSync(make_plan(config), name="DSSyncSGD", config=config)
        sync.connect("my step")                          # every rank, in the same order
        grads = sync.gradients(grads, step)              # inside the traced step
        sync.average(variables, step)
    """

    def __init__(self, plan, compression=hvd.Compression.none, op=hvd.Average, gradient_predivide_factor=1.0,
                 sparse_as_dense=False, device_dense="", name="DSSync", config=None, scope=None,
                 process_set=hvd.global_process_set, global_fragments=1, quickens=False):
        self.compression = compression
        self.process_set = process_set
        self.config = config
        self._registry = registry_for(hvd)
        self._generation = None  # the registry's generation when this rank last connected; None: not yet
        self._compared = None  # the generation whose averaged tensors the ranks compared; None: not yet
        # Inside a process set: the set's ranks, by position (see hvd_dssync.scope); else the whole job.
        self._scope = scope
        if self._in_process_set():
            # Before this object takes its op-name number: a refused set must not shift the later ones'.
            acquire_registered(hvd, scope, plan.schedule.window_groups(0), "hvd_dssync.keras",
                               allgather_rows=allgather_job_rows, ordered=self._ordered_sets())
        # Kept for the life of this object, through changes of world: a newcomer builds its StepSync
        # fresh, and its op names must equal the survivors'.
        self.name = f"{name}_{next(_instances)}"
        # The parts, each given what it needs; the switch of the plan comes with each call.
        self.guard = StepGuard(self.name)
        self.adaptive = AdaptiveStep(self.name)
        exact_average = ExactAverage(self.name, compression, device_dense)
        self.sparse = SparseRows(self.name, process_set, exact_average)  # embedding tables by their rows
        horovod_settings = {"op": op, "compression": compression, "sparse_as_dense": sparse_as_dense,
                            "gradient_predivide_factor": gradient_predivide_factor, "device_dense": device_dense}
        # overlap=True: each average runs on a thread of its own through the local steps that follow (.overlap);
        # overlap=None: a trial of both ways decides (hvd_dssync.overlap), where overlap can run at all.
        trial = config is not None and not elastic_job() and runs_trial(
            config.overlap, compression is not hvd.Compression.none, config.adaptive() is not None, plan.world_size,
            hvd.size() > hvd.local_size())
        # Where DS-Sync picked the racks' period (quickens), the trial probes whether they hide at half of it first
        # (hvd_dssync.rhythm): the plan takes the period it asks for.
        change = self._change_period if quickens else None
        self.choice = OverlapChoice(self.name, plan, process_set, change) if trial else None
        flight = InFlight(self.name) if config is not None and (config.overlap or trial) else None
        # A global average in flight goes in as many fragments as the trial chose, or as given (overlap=True).
        fragments_at = self.choice.fragments_at if trial else lambda step: global_fragments
        self.averaging = Averaging(horovod_settings, process_set, self.guard, self.sparse, exact_average, flight,
                                   self.choice, fragments_at)
        # Set once this process's step has taken rank 0's counter (:meth:`adopt_root_step`). A variable,
        # for the traced step to read; outside any Keras or tf.Module tracking, so never saved.
        # Created here, eagerly: a variable created while a tf.function is traced makes it trace again.
        with tf.init_scope():
            self._adopted = tf.Variable(False, trainable=False, name="dssync_step_adopted")
        self._use(plan)
        # The trial may change the rhythm of the branches (_change_period): then they are read from a variable.
        self._rhythm = None
        if self.choice is not None and quickens:
            with tf.init_scope():
                self._rhythm = tf.Variable(self._table, trainable=False, name="dssync_rhythm")
        watch_until_exit(self)

    # --- the plan, its process sets and the ranks' agreement ----------------------------------

    def _use(self, plan):
        self.plan = plan
        if not self._in_process_set():
            self._scope = Scope(tuple(range(plan.world_size)), plan.rank)
        self.switch = Switch.of(plan, self._scope, self.process_set, self._registry)
        self._table = self._branch_table()
        if plan.adaptive is not None:
            self.adaptive.use(self._table)

    def connect(self, what, parameters=None, options=None):
        """Check that all ranks were configured alike, then register the process sets (collectives).

        Every rank raises the same ``ValueError`` on a mismatch, before any process set is added.
        """
        generation = self._registry.refresh()

        check_ranks_agree(self._allgather, self.plan, parameters, options, what)
        self._compared = generation if parameters is not None else None
        if self.plan.world_size > 1 and not self._in_process_set():
            acquire, _ = self.plan.window_change(0)
            self._registry.acquire(acquire, ordered=self._ordered_sets())
        self._generation = generation

    def _allgather(self, payload):
        return hvd.allgather(tf.constant(payload), name=f"{self.name}_agreement", process_set=self.process_set).numpy()

    def _ordered_sets(self):
        """Whether the groups' sets may be marked ordered: not where sparse averaging gathers rows on them."""
        return not (self.config is not None and self.config.sparse_average)

    def ensure_connected(self, what, parameters=None, options=None):
        """:meth:`connect` once per Horovod world; call it where every rank is at the same point.

        Runs eagerly even while a step is traced (``tf.init_scope``). Without communication it notices a
        re-initialized Horovod (the registry's generation) and rebuilds the plan for the new world first.
        ``parameters`` (what the step averages, known once it is traced) are compared once per world too: by
        the connect, or by one more agreement check where the world was connected without them.
        """
        with tf.init_scope():
            generation = self._registry.refresh()
            if generation == self._generation:
                if parameters is not None and self._compared != generation:
                    check_ranks_agree(self._allgather, self.plan, parameters, options, what)
                    self._compared = generation
                return
            if self._generation is not None or (not self._in_process_set() and
                                                (self.plan.world_size, self.plan.rank) != (hvd.size(), hvd.rank())):
                self.rebuild()
            self.connect(what, parameters, options)

    def rebuild(self):
        """The plan of the current Horovod world, from the same configuration; keeps the op names. No communication.

        ``num_groups``/``group_size`` are capped at the new world size
        (:meth:`hvd_dssync.config.SyncConfig.for_world`); a schedule object or a topology raises a
        ``RuntimeError``. The next :meth:`ensure_connected` connects.
        """
        if self.plan.world_size == hvd.size() and self.plan.rank == hvd.rank() and self._generation is None:
            return
        if self.config is None:
            raise RuntimeError("hvd_dssync: the Horovod world changed, and this DS-Sync object was built without "
                               "its arguments, so it cannot rebuild its schedule.")
        self._use(make_plan(self.config.for_world(hvd.size())))
        self._generation = None
        self.averaging.forget_reference()
        self.sparse.restart()  # the next runs check again whether the tables are equal

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

    # --- the switch's branch of every step -----------------------------------------------------

    def _branch_table(self):
        """Branches for the steps after warm-up, one period long: the policy and cycle repeat after it.

        The policy's kinds repeat every ``policy.period()`` steps, and the schedule advances a whole
        number of times in each, so ``period() * cycle`` steps bring both back to their start.
        """
        policy, schedule = self.plan.policy, self.plan.schedule
        start = policy.warmup_steps
        if self.plan.adaptive is not None:
            return self.adaptive.table(self.switch, start)
        period = policy.period() * len(schedule.partitions(0))
        return np.array([self.switch.branch_of(self.plan.action(start + i)) for i in range(period)], dtype=np.int32)

    def _change_period(self, step, every):
        """The racks' period the trial asks for, from the plan's first period from ``step`` on, the first step not
        taken yet (every rank at the same step, eagerly): the table of branches of the steps from there, as long as
        the one in force (a multiple of both periods), each at the place ``branch`` reads for its step. Returns a
        function that puts it in force at the end of a step: before its first step, and only there."""
        start, length, warmup = self.plan.change_period(step, every), len(self._table), self.plan.policy.warmup_steps
        steps = [start + (warmup + i - start) % length for i in range(length)]
        table = np.array([self.switch.branch_of(self.plan.action(t)) for t in steps], dtype=np.int32)
        if self.process_set.rank() == 0:
            log.info(f"hvd_dssync: the racks average every {every} steps from step {start}")

        def at_end_of(ended):
            if ended + 1 == start:
                self._table = table
                self._rhythm.assign(table)
        return at_end_of

    def branch(self, step):
        """The switch branch of ``step`` (an integer tensor), computed in the graph."""
        step = tf.cast(step, tf.int64)
        warmup = self.plan.policy.warmup_steps
        offset = tf.math.floormod(tf.maximum(step - warmup, 0), len(self._table))
        window = self.adaptive.window
        variable = window if window is not None else self._rhythm
        table = tf.constant(self._table) if variable is None else variable.read_value()
        branch = tf.gather(table, offset)
        if warmup:
            branch = tf.where(step < warmup, tf.constant(KEEP_BRANCH, tf.int32), branch)
        return branch

    def _in_process_set(self):
        return self.process_set is not hvd.global_process_set

    # --- the step: the parts' work, with the switch of the plan and the world check -------------

    def gradients(self, grads, step):
        """``grads`` averaged over all ranks in a warm-up step, else unchanged
        (:meth:`.averaging.Averaging.gradients`)."""
        return self.averaging.gradients(self.switch, grads, step, self.world_check())

    def allreduce_gradients(self, grads):
        """``grads`` reduced over all ranks, at any step (:meth:`.averaging.Averaging.allreduce_gradients`)."""
        return self.averaging.allreduce_gradients(self.switch, grads, self.world_check())

    def average(self, variables, step):
        """An op that assigns to ``variables`` their average inside this rank's group at ``step`` (a tensor)."""
        variables = list(variables)
        check = self.world_check()
        if self.plan.world_size == 1 or not variables or not self._table.any():
            return tf.group(*check)
        averaged = self.averaging.average(self.switch, variables, step, self.branch(step), check)
        if self.choice is None:
            return averaged
        with tf.control_dependencies([averaged]):
            return self.choice.end_step(step, [tuple(v.shape) for v in variables], variables[0].dtype)

    @property
    def overlap(self):
        """Whether the averages run behind compute: True, False, or None while the default's trial runs."""
        if self.choice is None:
            return bool(self.config is not None and self.config.overlap)
        return self.choice.trial.overlapping

    @property
    def overlap_trial(self):
        """What the default's trial decided and from what it timed, as it logs it; None where no trial runs."""
        return None if self.choice is None else self.choice.trial.describe()

    def drain(self):
        """Fold in the average in flight (``overlap=True``, or the default's trial), eagerly; nothing otherwise.
        Call it on every rank, where the models must be what waited averages would have left
        (``synchronize_models``, exit)."""
        if self.averaging.overlapped is not None:
            self.averaging.overlapped.drain()

    def adapt(self, step, seconds, compute_seconds):
        """Note a step's figures under the adaptive policy and decide at a decision step
        (:meth:`.adaptive_step.AdaptiveStep.adapt`)."""
        return self.adaptive.adapt(self.switch, step, seconds, compute_seconds)


def _dense_values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
