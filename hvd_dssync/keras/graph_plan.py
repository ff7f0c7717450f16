"""The :class:`SyncPlan` a traced Keras step can follow: one endless window of groups."""
import horovod.tensorflow as hvd

from ..plan import SyncPlan, routes_global_averages

__all__ = ["make_plan"]


def make_plan(config, scope=None):
    """The :class:`SyncPlan` of this rank for ``config`` (a resolved :class:`hvd_dssync.config.SyncConfig`,
    see :meth:`~hvd_dssync.config.SyncConfig.resolve`); the schedule must keep its groups for the whole run.

    The pool of process sets a traced graph can use is fixed when it is traced, so a schedule with
    windows is refused ("topology" with ``rotate_every``, for example). With
    ``scope`` (a :class:`hvd_dssync.scope.Scope` of a process set) the plan is that of this rank's position
    in the set.

    Example::

        plan = make_plan(SyncConfig(num_groups=2, seed=0, schedule="shuffle"))
        plan.action(0)
    """
    rank, size = (hvd.rank(), hvd.size()) if scope is None else (scope.rank, scope.world_size)
    plan = SyncPlan.from_config(rank, size, config)
    routes_global_averages(plan.schedule, "Keras")  # never: True is refused, "auto" averages over every rank
    if plan.schedule.window_steps is not None:
        raise ValueError(
            f"hvd_dssync.keras: schedule {plan.schedule!r} changes its groups every "
            f"{plan.schedule.window_steps} steps (window_steps), but a traced graph keeps the process sets "
            "it was traced with. Use a schedule with one endless window (e.g. "
            "schedule_options={'window_steps': None} for 'shuffle', or 'butterfly').")
    return plan
