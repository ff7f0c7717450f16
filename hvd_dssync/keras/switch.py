"""The switch of a traced Keras step: the branch each step takes, and each branch's group and process set.

Horovod fixes an op's process set when a ``tf.function`` is traced, so the traced step holds one branch per
distinct group of this rank and ``tf.switch_case`` picks one from the step at run time (:mod:`.sync`).
A :class:`Switch` is what the step's parts need of it (:mod:`.averaging`, :mod:`.sparse_rows`,
:mod:`.step_guard`, :mod:`.adaptive_step`): made anew with each plan, since elastic Horovod can replace the
world, and handed to them at each call.

Example::

    switch = Switch.of(plan, scope, process_set, registry)
    switch.branch_of(plan.action(step))      # KEEP_BRANCH, GLOBAL_BRANCH or FIRST_GROUP_BRANCH + i
"""
from typing import Any, NamedTuple

import numpy as np

from ..plan import BSP, GLOBAL, GROUP, LOCAL, Action, carry_fate

__all__ = ["Switch", "KEEP_BRANCH", "GLOBAL_BRANCH", "FIRST_GROUP_BRANCH"]

# The switch's branches: no model averaging (a bulk-synchronous step, local steps, or a group of one), the
# average over all ranks, then one branch per distinct group of this rank.
KEEP_BRANCH, GLOBAL_BRANCH, FIRST_GROUP_BRANCH = 0, 1, 2


class Switch(NamedTuple):
    """The plan a step was traced for, this rank's groups in branch order and their process sets."""

    plan: Any  # hvd_dssync.plan.SyncPlan
    scope: Any  # hvd_dssync.scope.Scope: the ranks DS-Sync runs among, and this rank's position
    groups: tuple  # this rank's distinct groups (positions in the scope): branch FIRST_GROUP_BRANCH + i
    process_set: Any  # the optimizer's Horovod process set: the global branch's
    registry: Any  # hvd_dssync.process_sets.ProcessSetRegistry: the groups' sets, once the step connected
    bridges: Any = None  # this rank's exact bridges by branch (see bridge_table), or None

    @classmethod
    def of(cls, plan, scope, process_set, registry):
        """The switch of ``plan`` for this rank (``plan.rank``), with its exact bridges."""
        groups = tuple(sorted({g for p in plan.schedule.partitions(0) for g in p
                               if plan.rank in g and 1 < len(g) < plan.world_size}))
        switch = cls(plan, scope, groups, process_set, registry)
        return switch._replace(bridges=switch.bridge_table())

    def set_of(self, group):
        """The Horovod process set of ``group`` (positions in the scope); registered when the step connects."""
        return self.registry.get(self.scope.to_global(group))

    def branch_sets(self):
        """``(process set, kind, size, is_global)`` of every averaging branch, in branch order from
        :data:`GLOBAL_BRANCH`: the sets of a traced step's ``tf.switch_case``."""
        return [(self.process_set, "global", self.plan.world_size, True)] + \
               [(self.set_of(g), "group", len(g), False) for g in self.groups]

    def sizes(self):
        """The group size of every branch, in branch order (1 for :data:`KEEP_BRANCH`)."""
        return [1, self.plan.world_size] + [len(g) for g in self.groups]

    def global_groups(self):
        """Every averaging branch's ranks (global ranks), by branch."""
        return {GLOBAL_BRANCH: self.scope.ranks,
                **{FIRST_GROUP_BRANCH + i: self.scope.to_global(g) for i, g in enumerate(self.groups)}}

    def branch_of(self, action):
        """The branch of the plan's ``action``."""
        if action.kind in (BSP, LOCAL) or len(action.group) == 1:
            return KEEP_BRANCH
        if action.kind == GLOBAL or len(action.group) == self.plan.world_size:
            return GLOBAL_BRANCH
        return FIRST_GROUP_BRANCH + self.groups.index(action.group)

    def bridge_table(self):
        """This rank's exact bridges by switch branch, or None where it never crosses on one: ``(crossing,
        scales, carries, adds)``, float arrays indexed by branch (:meth:`hvd_dssync.plan.SyncPlan.bridge`).
        At a ``crossing`` branch the rank sends the model its last average left times ``scales`` and adds the
        average's move to its model; at the others it sends its model plus ``adds`` times the carry waiting
        (the group branches add it, the global one drops it); after the average it carries ``carries``
        times its move. The schedule has one endless window here, so a group's bridge is the same wherever
        it comes round."""
        schedule, rank = self.plan.schedule, self.plan.rank
        size = FIRST_GROUP_BRANCH + len(self.groups)
        crossing, scales, carries = np.zeros(size), np.ones(size), np.zeros(size)
        for at in range(len(schedule.partitions(0))):
            bridge = schedule.bridge(rank, at)
            if bridge is not None:
                branch = self.branch_of(Action(GROUP, schedule.group_of(rank, at)))
                crossing[branch], scales[branch], carries[branch] = 1.0, bridge.scale, bridge.carry
        if not crossing.any():
            return None
        kind_of = {KEEP_BRANCH: LOCAL, GLOBAL_BRANCH: GLOBAL}  # every other branch is a group's
        adds = np.array([float(carry_fate(kind_of.get(branch, GROUP)) == "add") for branch in range(size)])
        return crossing, scales, carries, adds
