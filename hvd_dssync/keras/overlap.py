"""Overlap for the Keras adapter (``overlap=True``): a step's average runs behind the local steps that follow
and is folded in as ``model += average - sent`` at the first step that finds it done (a poll), at the latest
where the next average starts (a global one, a step after it started: :func:`hvd_dssync.overlap.folds_now`),
as in the PyTorch adapter.

A traced step cannot leave a Horovod op in flight: a ``tf.function`` returns once all its ops are done. So
the values to average leave the graph through ``tf.py_function`` to a thread of this process
(:class:`InFlight`) that runs Horovod's eager grouped allreduce on the step's process set, named by the
step's op names; a later step takes the result (the next averaging step waits for it if it is not done) and
folds it in, the exact bridges' move and carry included (:mod:`.averaging` gives the bridges' state).
Every member issues the same averages in the same order, each from one thread, so Horovod sees the same op
sequence on every rank. :meth:`OverlappedAveraging.drain` folds in what is in flight eagerly: before
``synchronize_models`` and at exit.
"""
import threading

import horovod.tensorflow as hvd
import tensorflow as tf

from ..overlap import folds_now
from .switch import GLOBAL_BRANCH, KEEP_BRANCH

__all__ = ["InFlight", "OverlappedAveraging"]


class InFlight:
    """At most one grouped average in flight on a thread of its own, with the step and switch branch it is of.

    Example::

        flight = InFlight("DSSyncSGD_0")
        flight.start(values, process_set, "group", (step, branch))   # returns at once
        ...                                                           # local steps
        flight.at                                                     # (step, branch)
        averaged = flight.take()          # waits if it is not done; raises what it raised
    """

    def __init__(self, name):
        self.name = name
        self._thread, self._box, self.at = None, None, None

    @property
    def pending(self):
        return self._thread is not None

    def done(self):
        """Whether the average in flight is done (a poll: it never waits)."""
        return self._thread is not None and not self._thread.is_alive()

    def start(self, values, process_set, kind, at):
        if self._thread is not None:
            raise RuntimeError("hvd_dssync: an overlapped average started while another was in flight")
        box = {}

        def run():
            try:
                box["out"] = hvd.grouped_allreduce(values, op=hvd.Average, process_set=process_set,
                                                   ignore_name_scope=True,
                                                   name=f"{self.name}_overlap_{kind}_{process_set.process_set_id}")
            except BaseException as e:  # handed to take(), on the step's thread
                box["error"] = e

        self._thread, self._box, self.at = threading.Thread(target=run, name="hvd_dssync-overlap", daemon=True), box, at
        self._thread.start()

    def take(self):
        """The average in flight, waited for; what it raised is raised here."""
        thread, box = self._thread, self._box
        self._thread, self._box, self.at = None, None, None
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["out"]


class OverlappedAveraging:
    """A traced step's overlapped average: fold in the one in flight, then send this step's.

    It is given the step guard, the in-flight average, ``kept(store, variable, name)`` (a variable per model
    variable: :meth:`.averaging.Averaging.kept`) and ``bridge(switch, variables, branch)``, the exact bridges'
    tables and state, shared with waited averages (:meth:`.averaging.Averaging.bridge`). Whether an average is
    in flight, and of which step and branch, is the :class:`InFlight`'s to say; the graph asks it. Each call
    gets the step's switch.

    Example::

        overlapped = OverlappedAveraging(guard, InFlight(name), averaging.kept, averaging.bridge)
        overlapped.average(switch, variables, step, branch, check)      # inside the traced step
        overlapped.drain()                                              # eagerly, where models must agree
    """

    def __init__(self, guard, flight, kept, bridge):
        self.guard, self.flight, self.kept, self.bridge = guard, flight, kept, bridge
        self._sent = {}  # per variable: what this rank sent (what its average's move is measured from)
        self._last = None  # (switch, variables) of the last traced step, for drain()

    def average(self, switch, variables, step, branch, check):
        """An op: fold in the average in flight where it is done (a poll) or, waiting for it, where this step
        averages (``branch``) or a global one is due (:func:`hvd_dssync.overlap.folds_now`); then start this
        step's."""
        self._last = (switch, list(variables))
        averaging = tf.not_equal(branch, KEEP_BRANCH)

        def due(averaging, step):
            flight = self.flight
            return flight.pending and (bool(averaging) or
                                       folds_now(switch.plan.action(flight.at[0]).kind, flight.at[0], int(step),
                                                 flight.done()))

        with tf.control_dependencies(check):
            fold_now = tf.py_function(due, [averaging, tf.cast(step, tf.int64)], tf.bool,
                                      name=f"{self.flight.name}_overlap_poll")
        fold_now.set_shape([])
        folded = tf.cond(fold_now, lambda: self._fold(switch, variables), lambda: tf.constant(False))
        with tf.control_dependencies([folded]):
            return tf.cond(averaging, lambda: self._send(switch, variables, step, branch), lambda: tf.constant(False))

    def fold_in_flight(self, switch, variables, check):
        """An op: fold in the average in flight, if any, waiting for it (before a waited average)."""
        with tf.control_dependencies(check):
            pending = tf.py_function(lambda: self.flight.pending, [], tf.bool, name=f"{self.flight.name}_overlap_pending")
        pending.set_shape([])
        return tf.cond(pending, lambda: self._fold(switch, variables), lambda: tf.constant(False))

    def drain(self):
        """Fold in the average in flight now (eagerly), if any: before anything that needs the ranks' models
        as they would be without overlap. Call it on every rank of the groups."""
        if not self.flight.pending or self._last is None:
            return
        switch, variables = self._last
        self._fold(switch, variables)

    def _fold(self, switch, variables):
        """``model += average - sent`` for the average in flight; at an exact bridge, its carry and the
        model the next bridge sends are set as a waited average sets them. Returns a boolean tensor."""
        step, branch = tf.py_function(lambda: self.flight.at, [], [tf.int64, tf.int32],
                                      name=f"{self.flight.name}_overlap_at")
        step.set_shape([])
        branch.set_shape([])
        guard, dtypes = self.guard, [v.dtype for v in variables]
        begun = guard.begin(switch, branch, step, "group")
        with tf.control_dependencies([begun]):
            *averaged, means = tf.py_function(self.flight.take, [], dtypes + [dtypes[0]],
                                              name=f"{self.flight.name}_overlap_take")
        for a, v in zip(averaged, variables):
            a.set_shape(v.shape)
        with tf.control_dependencies(averaged + [means]):
            ended = guard.end(begun)
        sizes = tf.constant(switch.sizes(), tf.int32)
        with tf.control_dependencies([ended]):
            checked = guard.check(switch, means, step, tf.gather(sizes, branch))
        with tf.control_dependencies([checked]):
            sent = [self.kept(self._sent, v, "dssync_overlap_sent") for v in variables]
            moves = [a - s for a, s in zip(averaged, sent)]
            ops = [v.assign_add(m) for v, m in zip(variables, moves)]
        if switch.bridges is not None:
            crossing, _, factors, _, carries, agreed = self.bridge(switch, variables, branch)
            with tf.control_dependencies(ops):
                # The next bridge sends the model this average left: a crossing's folded-in model, else the
                # group's average (the same on every member), not the live model with its later local steps.
                ops = [c.assign(tf.cast(factors, m.dtype) * m) for c, m in zip(carries, moves)]
                ops += [k.assign(tf.where(crossing > 0, v.read_value(), a))
                        for k, v, a in zip(agreed, variables, averaged)]
        with tf.control_dependencies(ops):
            return tf.constant(True)

    def _send(self, switch, variables, step, branch):
        """Start this step's average on a thread: the model (or at a crossing, the model its last average left,
        times its scale), plus the carry an exact bridge left; what was sent is kept for the fold."""
        own = [v.read_value() for v in variables]
        base = values = own
        if switch.bridges is not None:
            crossing, scales, _, adds, carries, agreed = self.bridge(switch, variables, branch)
            base = [tf.where(crossing > 0, k.read_value(), o) for k, o in zip(agreed, own)]
            values = [b * tf.cast(scales, b.dtype) + c * tf.cast(adds, b.dtype) for b, c in zip(base, carries)]
        kept = [self.kept(self._sent, v, "dssync_overlap_sent").assign(b) for v, b in zip(variables, base)]
        bits = self.guard.signature(step, variables[0].dtype)
        sets = switch.branch_sets()

        def start(step, branch, *values):
            process_set, kind, _, _ = sets[int(branch) - GLOBAL_BRANCH]  # branch_sets() starts there
            self.flight.start(list(values), process_set, kind, (int(step), int(branch)))
            return True

        with tf.control_dependencies(kept):
            started = tf.py_function(start, [tf.cast(step, tf.int64), tf.cast(branch, tf.int32)] + values + [bits],
                                     tf.bool, name=f"{self.flight.name}_overlap_start")
        started.set_shape([])
        return started
