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

A global average may go in fragments (:mod:`hvd_dssync.fragments`: ``fragments_at(step)`` says how many): the
model's variables cut between their rows, fragment ``k`` sent at the ``k``-th step after the global average's
and folded in at the next, eagerly inside the step's ``tf.py_function`` (a slice of rows of each variable it
touches; a traced slice would need every count's shapes at trace time, and the trial picks the count later).
"""
import threading
from typing import NamedTuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..fragments import fragment_count, row_fragments, row_sizes
from ..guards import step_signature
from ..overlap import folds_now
from ..plan import GLOBAL
from .switch import GLOBAL_BRANCH, KEEP_BRANCH

__all__ = ["InFlight", "OverlappedAveraging", "Fragments"]


class Fragments(NamedTuple):
    """A global average going in fragments: fragment ``k`` of ``ranges`` (:func:`hvd_dssync.fragments.row_fragments`
    of the variables) is sent at step ``step + k``, over ``process_set``."""
    step: int
    ranges: list
    process_set: object
    rows: list  # each variable's elements in a row (a slice of its first axis)


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
        self.part = None  # a fragment of a global average: its parts, what this rank sent of each, the row sizes

    @property
    def pending(self):
        return self._thread is not None

    def done(self):
        """Whether the average in flight is done (a poll: it never waits)."""
        return self._thread is not None and not self._thread.is_alive()

    def start(self, values, process_set, kind, at, part=None):
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
        self.part = part
        self._thread.start()

    def take(self):
        """The average in flight, waited for; what it raised is raised here."""
        thread, box = self._thread, self._box
        self._thread, self._box, self.at, self.part = None, None, None, None
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["out"]


class OverlappedAveraging:
    """A traced step's overlapped average: fold in the one in flight, then send this step's.

    It is given the step guard, the in-flight average, ``kept(store, variable, name)`` (a variable per model
    variable: :meth:`.averaging.Averaging.kept`) and ``bridge(switch, variables, branch)``, the exact bridges'
    tables and state, shared with waited averages (:meth:`.averaging.Averaging.bridge`), and ``fragments_at(step)``:
    in how many fragments ``step``'s global average goes (1: whole), and ``on_fold(step, kind, started)``, told of
    each average in flight it folds in (the trial's :meth:`.overlap_choice.OverlapChoice.note_fold`). Whether an
    average is in flight, and of which step and branch, is the :class:`InFlight`'s to say; the graph asks it. Each
    call gets the step's switch.

    Example::

        overlapped = OverlappedAveraging(guard, InFlight(name), averaging.kept, averaging.bridge, lambda step: 4)
        overlapped.average(switch, variables, step, branch, check)      # inside the traced step
        overlapped.drain()                                              # eagerly, where models must agree
    """

    def __init__(self, guard, flight, kept, bridge, fragments_at=lambda step: 1, on_fold=None):
        self.guard, self.flight, self.kept, self.bridge = guard, flight, kept, bridge
        self.fragments_at, self.on_fold = fragments_at, on_fold
        self._sent = {}  # per variable: what this rank sent (what its average's move is measured from)
        self._last = None  # (switch, variables) of the last traced step, for drain()
        self._fragments = None  # a global average going in fragments (Fragments) with some still to send

    def average(self, switch, variables, step, branch, check):
        """An op: fold in the average in flight where it is done (a poll) or, waiting for it, where this step
        averages (``branch``) or a global one (or a fragment of one) is due (:func:`hvd_dssync.overlap.folds_now`);
        send the next fragment of a global average going in fragments; then start this step's."""
        self._last = (switch, list(variables))
        averaging = tf.not_equal(branch, KEEP_BRANCH)

        def due(averaging, step):
            flight = self.flight
            if not flight.pending:
                return False
            kind = GLOBAL if flight.part is not None else switch.plan.action(flight.at[0]).kind
            fold = bool(averaging) or folds_now(kind, flight.at[0], int(step), flight.done())
            if fold and self.on_fold is not None:
                self.on_fold(int(step), kind, flight.at[0])
            return fold

        with tf.control_dependencies(check):
            fold_now = tf.py_function(due, [averaging, tf.cast(step, tf.int64)], tf.bool,
                                      name=f"{self.flight.name}_overlap_poll")
        fold_now.set_shape([])
        folded = tf.cond(fold_now, lambda: self._fold(switch, variables), lambda: tf.constant(False))
        with tf.control_dependencies([folded]):
            sent = self.send_next_fragment(variables, step, averaging)
        with tf.control_dependencies([sent]):
            return tf.cond(averaging, lambda: self._send(switch, variables, step, branch), lambda: tf.constant(False))

    def fold_in_flight(self, switch, variables, check):
        """An op: fold in the average in flight, if any, waiting for it (before a waited average)."""
        with tf.control_dependencies(check):
            pending = tf.py_function(lambda: self.flight.pending, [], tf.bool,
                                     name=f"{self.flight.name}_overlap_pending")
        pending.set_shape([])
        return tf.cond(pending, lambda: self._fold(switch, variables), lambda: tf.constant(False))

    def send_next_fragment(self, variables, step, averaging):
        """An op: where a global average goes in fragments and this step (a local one: ``averaging`` false) is
        the next one's, send it (the average before it folded in first); an averaging step drops what is left
        (never, where the fragments are at most the steps between two averages)."""
        def more(averaging):
            if averaging:
                self._fragments = None
            return self._fragments is not None

        going = tf.py_function(more, [averaging], tf.bool, name=f"{self.flight.name}_overlap_fragments")
        going.set_shape([])
        return tf.cond(going, lambda: self._send_rows(variables, step), lambda: tf.constant(False))

    def _send_rows(self, variables, step):
        """An op: send the fragment due at ``step``; only the rows it sends leave the graph (the whole model's
        values took 15 ms a step more)."""
        bounds = tf.py_function(lambda step: self._rows_due(int(step), len(variables)), [tf.cast(step, tf.int64)],
                                tf.int64, name=f"{self.flight.name}_overlap_rows")
        bounds.set_shape([len(variables), 2])
        rows = [(v if v.shape.rank else tf.reshape(v, [1]))[bounds[i, 0]:bounds[i, 1]]
                for i, v in enumerate(variables)]
        sent = tf.py_function(lambda step, *rows: self._send_fragment(int(step), rows),
                              [tf.cast(step, tf.int64)] + rows, tf.bool, name=f"{self.flight.name}_overlap_next")
        sent.set_shape([])
        return sent

    def drain(self):
        """Fold in the average in flight now (eagerly), if any: before anything that needs the ranks' models
        as they would be without overlap. Call it on every rank of the groups."""
        if not self.flight.pending or self._last is None:
            return
        switch, variables = self._last
        self._fold(switch, variables)

    def _fold(self, switch, variables):
        """``model += average - sent`` for the average in flight (:meth:`_fold_whole`, or a fragment's
        :meth:`_fold_fragment`). Returns a boolean tensor."""
        fragment = tf.py_function(lambda: self.flight.part is not None, [], tf.bool,
                                  name=f"{self.flight.name}_overlap_fragment")
        fragment.set_shape([])

        def fold_fragment():
            folded = tf.py_function(lambda: self._fold_fragment(switch, variables), [], tf.bool,
                                    name=f"{self.flight.name}_overlap_fold_fragment")
            folded.set_shape([])
            return folded

        return tf.cond(fragment, fold_fragment, lambda: self._fold_whole(switch, variables))

    def _fold_whole(self, switch, variables):
        """``model += average - sent`` for a whole average in flight; at an exact bridge, its carry and the
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
        """Start this step's average on a thread: a global one going in fragments sends its first
        (:meth:`_begin_fragments`), any other the whole model (:meth:`_send_whole`)."""
        def begin(step, branch):
            return self._begin_fragments(switch, variables, int(step), int(branch))

        fragmented = tf.py_function(begin, [tf.cast(step, tf.int64), tf.cast(branch, tf.int32)], tf.bool,
                                    name=f"{self.flight.name}_overlap_begin")
        fragmented.set_shape([])
        return tf.cond(fragmented, lambda: self._send_rows(variables, step),
                       lambda: self._send_whole(switch, variables, step, branch))

    def _begin_fragments(self, switch, variables, step, branch):
        """Whether ``step``'s average (of switch branch ``branch``) is a global one going in fragments
        (``fragments_at(step)``, at most one a step until the next average); if so, they begin here."""
        if branch != GLOBAL_BRANCH or switch.plan.action(step).kind != GLOBAL:
            return False
        count = fragment_count(self.fragments_at(step), switch.plan.policy.steps_to_next_average(step))
        if count > 1:
            shapes = [tuple(v.shape) for v in variables]
            self._fragments = Fragments(step, row_fragments(shapes, count), switch.process_set, row_sizes(shapes))
        return count > 1

    def _send_whole(self, switch, variables, step, branch):
        """Start this step's average of the whole model: the model (or at a crossing, the model its last average
        left, times its scale), plus the carry an exact bridge left; what was sent is kept for the fold."""
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

    def _rows_due(self, step, count):
        """The rows of each of ``count`` variables that the fragment due at ``step`` sends, ``[start, stop)`` (empty
        where it sends none of a variable's, or where none is due)."""
        bounds = np.zeros((count, 2), np.int64)
        fragments = self._fragments
        if fragments is None or not 0 <= step - fragments.step < len(fragments.ranges):
            return bounds
        for i, a, b in fragments.ranges[step - fragments.step]:
            bounds[i] = [a // fragments.rows[i], b // fragments.rows[i]]
        return bounds

    def _send_fragment(self, step, rows):
        """Send the fragment of the global average going in fragments that is due at ``step``: ``rows``, the
        rows of each variable that it sends (:meth:`_rows_due`). After the last, none is left. Eager, inside the
        step's ``tf.py_function``."""
        fragments = self._fragments
        k = step - fragments.step
        if not 0 <= k < len(fragments.ranges):
            self._fragments = None
            return False
        if k == len(fragments.ranges) - 1:
            self._fragments = None
        parts = fragments.ranges[k]
        sent = [np.array(rows[i].numpy().reshape(-1)) for i, _, _ in parts]  # copies: kept for the fold
        flat = np.concatenate(sent)
        bits = step_signature(step).astype(flat.dtype)
        self.flight.start([tf.constant(flat), tf.constant(bits)], fragments.process_set, f"fragment_{k}",
                          (step, GLOBAL_BRANCH), part=(parts, sent, fragments.rows))
        return True

    def _fold_fragment(self, switch, variables):
        """``model += average - sent`` for a fragment in flight, on the slices of rows it sent; at an exact bridge
        the model the next bridge sends takes the fragment's average there and the carry is dropped there, as a
        waited global average does. Eager, inside the step's ``tf.py_function``; returns True."""
        step, branch = self.flight.at
        parts, sent, row_of = self.flight.part
        guard = self.guard
        begun = guard.begin(switch, tf.constant(branch, tf.int32), tf.constant(step, tf.int64), "group")
        averaged, means = self.flight.take()
        guard.end(begun)
        guard.check(switch, means, tf.constant(step, tf.int64), switch.plan.world_size)
        averaged = averaged.numpy()
        kept = None if switch.bridges is None else self.bridge(switch, variables, branch)[4:]  # carries, agreed
        offset = 0
        for (i, a, b), before in zip(parts, sent):
            average = averaged[offset:offset + b - a].astype(before.dtype, copy=False)
            offset += b - a
            variable, row = variables[i], row_of[i]
            rows = tf.range(a // row, b // row)
            shape = (b // row - a // row,) + tuple(variable.shape[1:]) if variable.shape.rank else ()
            _add_rows(variable, rows, (average - before).reshape(shape))
            if kept is not None:
                carry, agreed = kept[0][i], kept[1][i]
                _set_rows(carry, rows, tf.zeros(shape, before.dtype))
                _set_rows(agreed, rows, average.reshape(shape))
        return True


def _add_rows(variable, rows, value):
    """``variable[rows] += value`` (``rows``: indices of its first axis; a scalar whole), eagerly. A dense write
    of the whole variable: a scatter or a slice's assign would leave it in TF's copy-on-read mode for good (every
    later read and update copies it whole: a step reading a 23 MB kernel took 8.5 ms, 13 ms after one scatter;
    on 4 emulated hosts the median step 0.153 s against 0.135). This costs 10-11 ms a fold of that kernel."""
    if variable.shape.rank:
        variable.assign(tf.tensor_scatter_nd_add(variable.read_value(), tf.reshape(rows, [-1, 1]), value))
    else:
        variable.assign_add(value)


def _set_rows(variable, rows, value):
    """``variable[rows] = value`` (a scalar whole), eagerly; a dense write, as :func:`_add_rows`."""
    if variable.shape.rank:
        variable.assign(tf.tensor_scatter_nd_update(variable.read_value(), tf.reshape(rows, [-1, 1]), value))
    else:
        variable.assign(value)
