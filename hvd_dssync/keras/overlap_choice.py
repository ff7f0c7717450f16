"""The default's choice of overlap in the Keras adapter (``overlap=None``): the trial of :mod:`hvd_dssync.overlap`
timed on this rank's steps, its figures gathered once over the optimizer's ranks, as in the PyTorch adapter.

The traced step reads the way of each average from :attr:`OverlapChoice.overlapped` (a variable), so one
traced ``train_function`` serves the trial's waited steps, its overlapped ones and the decision; the step's
end (``tf.py_function``) times the step and sets the variable for the next one. The global averages have no
route through the racks here: waited, each is the ring over every rank; a probe after the set-up period chooses in
how many fragments they go in flight (:meth:`hvd_dssync.overlap.OverlapTrial.decide_globals`), and the trial keeps
them in flight or not on their own, as in the PyTorch adapter.
"""
import logging
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from ..fragments import row_fragments
from ..overlap import OverlapTrial
from ..plan import GLOBAL, LOCAL

__all__ = ["OverlapChoice"]

log = logging.getLogger("hvd_dssync")


class OverlapChoice:
    """Which way each step averages while the trial runs, and the decision at its end.

    Args:
        name: the optimizer's op names.
        plan: the optimizer's :class:`hvd_dssync.plan.SyncPlan` (the warm-up, the averaging period, and the
            schedule's cycle of averages).
        process_set: the optimizer's Horovod process set (the ranks that decide together).
        change_period: where the racks' period is the default's, what changes it to the one the trial asks for
            (``trial.average_every``: :mod:`hvd_dssync.rhythm`): ``change_period(step, every)`` from the plan's first
            period from ``step`` on, eagerly on every rank; it returns what to call at the end of each step after.

    Example::

        choice = OverlapChoice("DSSyncSGD_0", plan, hvd.global_process_set)
        tf.cond(choice.overlapped, overlapped_average, waited_average)   # inside the traced step
        choice.fragments_at(step)                                        # a global average's fragments (Python)
        choice.end_step(step, shapes, dtype)                             # after it (a tensor; an op)
    """

    def __init__(self, name, plan, process_set, change_period=None):
        self.name = name
        self.plan = plan
        self.process_set = process_set
        self.trial = OverlapTrial.of(plan, choose_globals=True, through_racks=False,
                                     quickens=change_period is not None)
        self.change_period, self._changing = change_period, None
        # Created eagerly: a variable created while a tf.function is traced makes it trace again.
        with tf.init_scope():
            self.overlapped = tf.Variable(self.way_at(0), trainable=False, name="dssync_overlapped")

    def rule_out(self):
        """Overlap cannot run here (an embedding table averaged by its rows, found alike on every rank at
        trace time): off, no trial."""
        if self.trial.decided is None:
            self.trial.rule_out()
            with tf.init_scope():
                self.overlapped.assign(False)

    def way_at(self, step):
        """Whether ``step``'s average goes in flight: a global one where the trial sends it in fragments (or
        whole, where it chooses no way for them), any other where overlap is on."""
        if self.trial.globals_at and self.plan.action(step).kind == GLOBAL:
            return self.trial.fragments_at(step) > 0
        return self.trial.overlap_at(step)

    def fragments_at(self, step):
        """In how many fragments ``step``'s global average goes in flight (1: whole)."""
        return self.trial.fragments_at(step) if self.trial.globals_at else 1

    def note_fold(self, step, kind, started):
        """An average in flight of ``kind``, started at step ``started``, folded in at ``step``: what the trial weighs
        the other averages' saving against (:meth:`hvd_dssync.overlap.OverlapTrial.note_fold`)."""
        self.trial.note_fold(step, kind, started)

    def end_step(self, step, shapes, dtype):
        """An op: time the step ``step`` (a tensor) from the end of the one before; at the trial's first look and
        its last step, gather every rank's figures over the optimizer's process set and decide (a collective,
        at the same step everywhere); after the set-up period, probe the global averages' way, choose it, and warm
        the fragments where it chose them (``shapes``: the averaged variables', of ``dtype``); set the way of the next
        step's average."""
        return tf.py_function(lambda step: self._end_step(int(step), shapes, dtype.as_numpy_dtype),
                              [tf.cast(step, tf.int64)], tf.bool, name=f"{self.name}_overlap_trial")

    def _end_step(self, step, shapes, dtype):
        def gather(figures):
            return hvd.allgather(tf.constant(figures), name=f"{self.name}_overlap_trial",
                                 process_set=self.process_set, ignore_name_scope=True).numpy()

        def allreduce(fragments, name):
            # Zeros of the first of that many fragments of the model.
            elements = sum(b - a for _, a, b in row_fragments(shapes, fragments)[0])
            hvd.allreduce(tf.zeros([elements], dtype), op=hvd.Sum, name=f"{self.name}_overlap_{name}",
                          process_set=self.process_set, ignore_name_scope=True)

        def warm(fragments):
            # The fragments' first op, untimed: the first fragment's (on the bench a first fold cost more than the
            # next).
            allreduce(fragments, "warm")

        def probe(fragments):
            # One fragment's ring, timed after an untimed one and a tiny op every rank leaves together.
            allreduce(fragments, "probe_warm")
            hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name=f"{self.name}_overlap_together", process_set=self.process_set,
                          ignore_name_scope=True)
            started = time.perf_counter()
            allreduce(fragments, "probe")
            return time.perf_counter() - started

        local = self.plan.action(step).kind == LOCAL
        if self.trial.step_ended(step, gather, local, warm, probe=probe) is not None and self.process_set.rank() == 0:
            log.info(f"hvd_dssync: {self.trial.describe()}, from step {step + 1}")
        if self.change_period is not None and self.trial.average_every != self.plan.policy.average_every:
            self._changing = self.change_period(step + 1, self.trial.average_every)
        if self._changing is not None:
            self._changing(step)
        self.overlapped.assign(self.way_at(step + 1))
        return True
