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
    """The window of branches in force under the adaptive policy, and the decisions that set it.

    ``name`` names its ops; each call gets the step's :class:`.switch.Switch` (the policy is its plan's
    ``adaptive``, the branches its own).

    Example::

        adaptive = AdaptiveStep("DSSyncSGD_0")
        adaptive.use(adaptive.table(switch, plan.policy.warmup_steps))   # when the plan is (re)built
        decision = adaptive.adapt(switch, step, seconds, compute_seconds)  # after each step, on every rank
    """

    def __init__(self, name):
        self.name = name
        self.window = None  # the branches of the window in force, a variable; None: not adaptive
        self.decisions = []  # the adaptive policy's decisions, as dicts (see adapt)

    def use(self, table):
        """Set the window's branches to ``table``; the variable is made the first time (eagerly)."""
        with tf.init_scope():
            if self.window is None:
                self.window = tf.Variable(table, trainable=False, name="dssync_adaptive_window")
            else:
                self.window.assign(table)

    def table(self, switch, start):
        """The adaptive policy's branches for the window that starts at ``start``, from its decision in force."""
        plan = switch.plan
        actions = [(kind, plan.schedule.group_of(plan.rank, at) if kind == GROUP else plan.world)
                   for kind, at in plan.adaptive.planned(start)]
        return np.array([switch.branch_of(Action(*a)) for a in actions], dtype=np.int32)

    def adapt(self, switch, step, seconds, compute_seconds):
        """Note step ``step``'s figures under the adaptive policy; at a decision step, decide and set the next
        window's branches. Call it on every rank after each step (``SyncStatsCallback`` does), before the
        next: a decision step gathers every rank's figures (one small allgather, eager; the traced step's
        averages cannot carry them as the PyTorch adapter's do). Returns the
        decision's dict at a decision step, else None.
        """
        adaptive = switch.plan.adaptive
        kind = adaptive.action(step)
        decision = adaptive.end_step(step, kind, seconds if kind in (GLOBAL, GROUP) else math.nan, compute_seconds,
                                     gather=lambda figures: self._gather_figures(switch, figures))
        if decision is not None:
            decision = decision.as_dict()
            self.decisions.append(decision)
        if adaptive.is_window_end(step):  # the next window's branches (a probe window's differ)
            self.window.assign(self.table(switch, step + 1))
        return decision

    def _gather_figures(self, switch, figures):
        return hvd.allgather(tf.constant(figures), name=f"{self.name}_adaptive",
                             process_set=switch.process_set).numpy()
