"""The default's choice of overlap in the Keras adapter (``overlap=None``): the trial of :mod:`hvd_dssync.overlap`
timed on this rank's steps, its figures gathered once over the optimizer's ranks, as in the PyTorch adapter.

The traced step reads the way of each average from :attr:`OverlapChoice.overlapped` (a variable), so one
traced ``train_function`` serves the trial's waited steps, its overlapped ones and the decision; the step's
end (``tf.py_function``) times the step and sets the variable for the next one.
"""
import logging

import horovod.tensorflow as hvd
import tensorflow as tf

from ..overlap import OverlapTrial

__all__ = ["OverlapChoice"]

log = logging.getLogger("hvd_dssync")


class OverlapChoice:
    """Which way each step averages while the trial runs, and the decision at its end.

    Args:
        name: the optimizer's op names.
        plan: the optimizer's :class:`hvd_dssync.plan.SyncPlan` (the warm-up, the averaging period, and the
            schedule's cycle of averages).
        process_set: the optimizer's Horovod process set (the ranks that decide together).

    Example::

        choice = OverlapChoice("DSSyncSGD_0", plan, hvd.global_process_set)
        tf.cond(choice.overlapped, overlapped_average, waited_average)   # inside the traced step
        choice.end_step(step)                                            # after it (a tensor; an op)
    """

    def __init__(self, name, plan, process_set):
        self.name = name
        self.process_set = process_set
        self.trial = OverlapTrial.of(plan)
        # Created eagerly: a variable created while a tf.function is traced makes it trace again.
        with tf.init_scope():
            self.overlapped = tf.Variable(self.trial.overlap_at(0), trainable=False, name="dssync_overlapped")

    def rule_out(self):
        """Overlap cannot run here (an embedding table averaged by its rows, found alike on every rank at
        trace time): off, no trial."""
        if self.trial.decided is None:
            self.trial.rule_out()
            with tf.init_scope():
                self.overlapped.assign(False)

    def end_step(self, step):
        """An op: time the step ``step`` (a tensor) from the end of the one before; at the trial's first look and
        its last step, gather every rank's figures over the optimizer's process set and decide (a collective,
        at the same step everywhere); set the way of the next step's average."""
        return tf.py_function(self._end_step, [tf.cast(step, tf.int64)], tf.bool, name=f"{self.name}_overlap_trial")

    def _end_step(self, step):
        def gather(figures):
            return hvd.allgather(tf.constant(figures), name=f"{self.name}_overlap_trial",
                                 process_set=self.process_set, ignore_name_scope=True).numpy()

        step = int(step)
        if self.trial.step_ended(step, gather) is not None and self.process_set.rank() == 0:
            log.info(f"hvd_dssync: {self.trial.describe()}, from step {step + 1}")
        self.overlapped.assign(self.trial.overlap_at(step + 1))
        return True
