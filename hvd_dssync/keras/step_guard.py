"""The step guard of a traced Keras step: the step's signature carried by every average and its check,
the watchdog's bound on every wait, and the time spent waiting.

The rule is the core's (:mod:`hvd_dssync.guards`): every average carries the step's bits, 0 or 1 in the
averaged dtype, and the members of a group are at the same step exactly when no bit's mean is split. Here
both ends run inside the graph, as ``tf.numpy_function`` ops around the core's functions.
"""
import itertools
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..guards import step_signature, steps_differ
from ..watchdog import describe_wait, process_watchdog

__all__ = ["StepGuard", "SIGNATURE_LENGTH"]

SIGNATURE_LENGTH = len(step_signature(0))


class StepGuard:
    """The signature of a step, the watchdog over its waits and the seconds they took.

    ``name`` names its ops; the calls that need the groups get the step's :class:`.switch.Switch`.

    Example::

        guard = StepGuard("DSSyncSGD_0")
        bits = guard.signature(step, values[0].dtype)
        begun = guard.begin(switch, branch, step, "group")
        ...                                                      # the average of values + [bits]: means last
        ended = guard.end(begun)
        checked = guard.check(switch, means, step, group_size)   # after ended
    """

    def __init__(self, name):
        self.name = name
        self.watchdog = process_watchdog(hvd.shutdown)
        self._open, self._opened = {}, itertools.count()
        self.sync_seconds = 0.0  # wall time this rank spent in its averages, as seen from Python

    def signature(self, step, dtype):
        """The core's :func:`step_signature` of ``step`` (a tensor) in ``dtype``, to ride along with an average.

        0 and 1 and their group means are exact enough in any float (float16 included) for the check.
        """
        def bits(step):
            return step_signature(step).astype(dtype.as_numpy_dtype)

        out = tf.numpy_function(bits, [tf.cast(step, tf.int64)], dtype, stateful=False,
                                name=f"{self.name}_step_bits")
        out.set_shape([SIGNATURE_LENGTH])
        return out

    def check(self, switch, means, step, group_size):
        """An assertion that every member of the group that averaged ``means`` (its signatures) is at ``step``.

        Op names do not carry the step, so a rank a step behind would otherwise average silently with the
        peers of another step whenever its group recurs; every member sees the same means, so all stop
        together. The decision is the core's :func:`steps_differ`.
        """
        means = tf.cast(means, tf.float64)

        def differ(means, members):
            return np.bool_(steps_differ(means * members, members))

        split = tf.numpy_function(differ, [means, tf.cast(group_size, tf.float64)], tf.bool, stateful=False,
                                  name=f"{self.name}_steps_differ")
        split.set_shape([])
        group_mean = tf.reduce_sum(means * tf.constant([2.0 ** i for i in range(SIGNATURE_LENGTH)], tf.float64))
        return tf.debugging.Assert(
            tf.logical_not(split),
            [f"hvd_dssync: ranks are at different DS-Sync steps: rank {switch.plan.rank} is at step",
             tf.cast(step, tf.int64), "while the members of its group (size", group_size,
             ") average to step", group_mean, "(every member must be at the same step; a rank that "
             "restored another checkpoint, or ran a step the others did not, differs)"],
            summarize=SIGNATURE_LENGTH, name=f"{self.name}_step_check")

    def begin(self, switch, branch, step, kind):
        """An op that opens this step's communication when ``branch`` communicates; returns its id tensor.

        In Python, once per step: it notes the time (``sync_seconds`` adds up the communication) and arms
        the process's watchdog (see :mod:`hvd_dssync.watchdog`), naming the group, which is resolved here
        at trace time. :meth:`end` closes it.
        """
        rank, world, groups = hvd.rank(), switch.scope.ranks, switch.global_groups()

        def begin(branch, step):
            group = groups.get(int(branch))
            if group is None:
                return np.int64(-1)
            kind_now = "global" if kind == "group" and group == world else kind
            token = self.watchdog.arm(describe_wait(rank, group, int(step), kind_now))
            opened = next(self._opened)
            self._open[opened] = (time.perf_counter(), token)
            return np.int64(opened)

        return tf.numpy_function(begin, [branch, tf.cast(step, tf.int64)], tf.int64, stateful=True,
                                 name=f"{self.name}_begin")

    def end(self, opened):
        """An op that closes what :meth:`begin` opened: the watchdog disarmed, the seconds counted."""
        def end(opened):
            if opened >= 0:
                started, token = self._open.pop(int(opened))
                self.watchdog.disarm(token)
                self.sync_seconds += time.perf_counter() - started
            return np.int64(0)

        return tf.numpy_function(end, [opened], tf.int64, stateful=True, name=f"{self.name}_end")
