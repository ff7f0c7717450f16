"""Keras callbacks for DS-Sync: the consensus model at the end; the consensus distance and the bytes sent
in the logs.

Put them before callbacks that read the logs or save the model (TensorBoard, ModelCheckpoint), so those
see the distance and the synchronized weights.
"""
import math
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from ..plan import BSP, GLOBAL, ring_allreduce_bytes
from .functions import consensus_distance, synchronize_models
from .optimizer import step_sync_of

__all__ = ["SynchronizeModelsCallback", "ConsensusDistanceCallback", "SyncStatsCallback"]


class SynchronizeModelsCallback(tf.keras.callbacks.Callback):
    """Average the models exactly over all ranks at the end of training (and, optionally, of each epoch).

    Afterwards every rank holds the same consensus model, so a model saved from any rank is the same. Before an
    evaluation or a prediction it folds in the average in flight (``overlap``) on the rank that evaluates.

    Args:
        every_epoch: also synchronize at the end of every epoch (before later callbacks save it).
        root_rank: the rank whose bits every rank copies after the average (by default the set's first).
        non_trainable: average non-trainable float variables (BatchNorm statistics) too.
        process_set: average over this Horovod process set's ranks only (the optimizer's ``process_set``).

    Example::

        model.fit(x, y, callbacks=[dss.callbacks.SynchronizeModelsCallback(every_epoch=True),
                                   tf.keras.callbacks.ModelCheckpoint("model.keras")])
    """

    def __init__(self, every_epoch=False, root_rank=None, non_trainable=True, process_set=hvd.global_process_set):
        super().__init__()
        self.every_epoch = every_epoch
        self.root_rank = root_rank
        self.non_trainable = non_trainable
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self._synchronize()

    def on_train_end(self, logs=None):
        self._synchronize()

    def on_test_begin(self, logs=None):
        """Before an evaluation (``validation_data`` in ``fit``, or ``evaluate``): fold in the average in flight
        (``overlap``), so the model evaluated is the one an average waited for would have left; this rank alone
        waits for its own op, no other op is issued."""
        sync = step_sync_of(self.model.optimizer)
        if sync is not None:
            sync.drain()

    on_predict_begin = on_test_begin

    def _synchronize(self):
        synchronize_models(self.model, self.root_rank, self.non_trainable, self.process_set)
        sync = step_sync_of(self.model.optimizer)
        if sync is not None and sync.process_set is self.process_set:
            sync.sparse.forget()  # every table is now equal on every rank: sparse averages restart empty


class ConsensusDistanceCallback(tf.keras.callbacks.Callback):
    """Report the consensus distance (see :func:`consensus_distance`) as ``logs["consensus_distance"]``.

    Measured at each epoch's end, so it appears in the progress bar, in ``History`` and in TensorBoard
    (put this callback before ``TensorBoard`` and before a ``SynchronizeModelsCallback(every_epoch=True)``).

    Example::

        model.fit(x, y, callbacks=[dss.callbacks.ConsensusDistanceCallback()])
    """

    def __init__(self, key="consensus_distance"):
        super().__init__()
        self.key = key

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs[self.key] = consensus_distance(self.model)


class SyncStatsCallback(tf.keras.callbacks.Callback):
    """Report this rank's synchronization in each epoch: bytes sent and seconds spent, in the epoch's logs.

    ``logs["dssync_bytes_sent"]`` is counted from the schedule: a step's allreduce over a group of ``k``
    ranks sends ``2 (k - 1) / k`` of the averaged bytes (ring allreduce), gradients in warm-up steps, the
    model otherwise. Embedding tables averaged by their rows (``sparse_average``) count the rows moved and
    the ids gathered, and ``logs["dssync_row_set"]`` is this rank's rows in play at the epoch's end.
    ``logs["dssync_sync_seconds"]`` is the wall time from the start of each step's allreduce to the end of its
    assignment, taken in the traced step (waiting for slower group members included), as the PyTorch adapter's
    ``opt.last_sync["seconds"]``.

    Under ``policy="adaptive"`` it also runs the policy: after every step it notes the step's seconds in
    and out of the averaging, and at each decision step it gathers the ranks' figures and sets the next
    window's branches (every rank alike, before the next step). The decision in force at the end of an
    epoch goes to the logs, so to ``History``: ``logs["dssync_global_averaging"]`` (1 for global averages,
    0 for group averages), ``logs["dssync_average_every"]`` and ``logs["dssync_decision_step"]``; every
    decision, with its figures, is in ``optimizer.dssync_decisions``.

    Args:
        key: the log key of the bytes.
        seconds_key: the log key of the seconds.

    Example::

        model.fit(x, y, callbacks=[dss.callbacks.SyncStatsCallback()])
    """

    def __init__(self, key="dssync_bytes_sent", seconds_key="dssync_sync_seconds"):
        super().__init__()
        self.key = key
        self.seconds_key = seconds_key
        self._first_step = 0
        self._first_seconds = 0.0
        self._first_sparse_bytes = 0
        self._last = None  # (step, time, sync seconds) after the last step adapted to

    def on_train_begin(self, logs=None):
        if step_sync_of(self.model.optimizer).plan.adaptive is None:
            return
        per_execution = getattr(self.model, "_steps_per_execution", None)
        if per_execution is not None and int(per_execution.numpy()) != 1:
            raise ValueError("policy='adaptive' decides between two steps, so it needs model.compile(..., "
                             f"steps_per_execution=1), got {int(per_execution.numpy())}.")
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        sync = step_sync_of(optimizer)
        if sync.plan.adaptive is None:
            return
        step, now = optimizer.sync_step - 1, time.perf_counter()
        if self._last is not None and self._last[0] == step:
            return  # a pass that only accumulated gradients
        seconds = math.nan if self._last is None else sync.guard.sync_seconds - self._last[2]
        compute = math.nan if self._last is None else now - self._last[1] - seconds
        sync.adapt(step, seconds, compute)
        self._last = (step, time.perf_counter(), sync.guard.sync_seconds)

    def on_epoch_begin(self, epoch, logs=None):
        self._first_step = self.model.optimizer.sync_step
        sync = step_sync_of(self.model.optimizer)
        self._first_seconds = sync.guard.sync_seconds
        self._first_sparse_bytes = sync.sparse.sparse_bytes

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        optimizer = self.model.optimizer
        sync = step_sync_of(optimizer)
        gradients = _nbytes(self.model.trainable_variables)
        model = gradients
        if sync.config.average_buffers:
            model += _nbytes(v for v in self.model.non_trainable_variables if v.dtype.is_floating)
        plan, by_rows = sync.plan, sync.sparse.row_sets is not None
        sent = sync.sparse.sparse_bytes - self._first_sparse_bytes if by_rows else 0
        for step in range(self._first_step, optimizer.sync_step):
            action = plan.action(step)
            if action.kind == BSP or not by_rows:
                sent += ring_allreduce_bytes(len(action.group), gradients if action.kind == BSP else model)
        logs[self.key] = sent
        if by_rows:
            logs["dssync_row_set"] = sync.sparse.row_sets.total()
        logs[self.seconds_key] = sync.guard.sync_seconds - self._first_seconds
        if plan.adaptive is not None:
            decision = plan.adaptive.decision
            logs["dssync_global_averaging"] = float(decision.mode == GLOBAL)
            logs["dssync_average_every"] = float(decision.period)
            logs["dssync_decision_step"] = float(decision.step)


def _nbytes(variables):
    return sum(v.shape.num_elements() * v.dtype.size for v in variables)
