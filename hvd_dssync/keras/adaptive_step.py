"""The adaptive policy's part of a traced Keras step (:mod:`hvd_dssync.adaptive`).

The traced step cannot change its graph at a decision, so the branches of the window in force live in a
variable that the step reads; after each step the ranks note their figures, and at a decision step they
gather them (one small allgather, eager), take the same decision and write the next window's branches.
"""
import math

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..plan import GLOBAL, GROUP, Action

__all__ = ["AdaptiveStep"]


class AdaptiveStep:
    """The window of branches in force under ``owner``'s adaptive policy, and the decisions that set it.

    ``owner`` is the :class:`hvd_dssync.keras.sync.StepSync`: the policy is its plan's (``plan.adaptive``);
    its branches (:meth:`StepSync.branch_of`), process set and op names are its own.

    Example::

        adaptive = AdaptiveStep(sync)
        adaptive.use(adaptive.table(plan.policy.warmup_steps))   # when the plan is (re)built
        decision = adaptive.adapt(step, seconds, compute_seconds)  # after each step, on every rank
    """

    def __init__(self, owner):
        self._owner = owner
        self.window = None  # the branches of the window in force, a variable; None: not adaptive
        self.decisions = []  # the adaptive policy's decisions, as dicts (see adapt)

    def use(self, table):
        """Set the window's branches to ``table``; the variable is made the first time (eagerly)."""
        with tf.init_scope():
            if self.window is None:
                self.window = tf.Variable(table, trainable=False, name="dssync_adaptive_window")
            else:
                self.window.assign(table)

    def table(self, start):
        """The adaptive policy's branches for the window that starts at ``start``, from its decision in force."""
        plan = self._owner.plan
        actions = [(kind, plan.schedule.group_of(plan.rank, at) if kind == GROUP else plan.world)
                   for kind, at in plan.adaptive.planned(start)]
        return np.array([self._owner.branch_of(None, Action(*a)) for a in actions], dtype=np.int32)

    def adapt(self, step, seconds, compute_seconds):
        """Note step ``step``'s figures under the adaptive policy; at a decision step, decide and set the next
        window's branches. Call it on every rank after each step (``SyncStatsCallback`` does), before the
        next: a decision step gathers every rank's figures (one small allgather, eager; the traced step's
        averages cannot carry them as the PyTorch adapter's do). Returns the
        decision's dict at a decision step, else None.
        """
        adaptive = self._owner.plan.adaptive
        kind = adaptive.action(step)
        decision = adaptive.end_step(step, kind, seconds if kind in (GLOBAL, GROUP) else math.nan, compute_seconds,
                                     gather=self._gather_figures)
        if decision is not None:
            decision = decision.as_dict()
            self.decisions.append(decision)
        if adaptive.is_window_end(step):  # the next window's branches (a probe window's differ)
            self.window.assign(self.table(step + 1))
        return decision

    def _gather_figures(self, figures):
        owner = self._owner
        return hvd.allgather(tf.constant(figures), name=f"{owner.name}_adaptive", process_set=owner.process_set).numpy()
