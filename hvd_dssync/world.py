"""What an adapter's parts need of the world a DS-Sync optimizer trains in, handed to them at each call.

Elastic Horovod can replace the world under a running optimizer (other ranks, another size): the optimizer
then builds a new :class:`World`, and its parts see it at their next call, since none of them keeps one.
Framework-free: the process set is whatever the framework's Horovod module calls one.

Example::

    world = World(plan, scope, process_set, joins, in_process_set=False)
    record = averaging.average_model(world, plan.action(step), step)
"""
from typing import Any, NamedTuple

__all__ = ["World", "Done"]


class World(NamedTuple):
    """The plan, the scope and the process set an optimizer steps in, and what it knows of joined ranks."""

    plan: Any  # hvd_dssync.plan.SyncPlan
    scope: Any  # hvd_dssync.scope.Scope: the ranks DS-Sync runs among, and this rank's position
    process_set: Any  # the optimizer's Horovod process set: the global set, or the user's
    joins: Any  # hvd_dssync.join.JoinState: ranks known to have run out of data
    in_process_set: bool  # whether DS-Sync runs inside a user's process set (its groups registered by the job)


class Done(NamedTuple):
    """What a step's synchronization did: the plan's action, its seconds, the bytes this rank sent, the rows
    of sparse tables it averaged, whether it was an average folded in from behind the steps (``overlapped``:
    its seconds are what it delayed training, not what the network cost), and the average in flight the step
    folded in (``folded``, for the trial of overlap). The optimizer turns it into ``last_sync``."""

    action: Any  # hvd_dssync.plan.Action
    seconds: float = 0.0
    bytes_sent: int = 0
    sparse_rows: int = 0
    overlapped: bool = False
    folded: Any = None  # an average in flight folded in at this step: (its kind, the step it started at)
