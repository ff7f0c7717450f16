"""The :class:`SyncPlan` a traced Keras step can follow: one endless window of groups."""
import horovod.tensorflow as hvd

from ..plan import SyncPlan, resolve_schedule
from .functions import default_topology, job_topology

__all__ = ["make_plan"]


def make_plan(num_groups=None, group_size=None, seed=0, schedule=None, topology=None, warmup_steps=0,
              global_every=0, average_every=1, schedule_options=None, scope=None, adaptive=None):
    """The :class:`SyncPlan` of this rank; the schedule must keep its groups for the whole run.

    The pool of process sets a traced graph can use is fixed when it is traced, so a schedule with
    windows is refused ("topology" with ``rotate_every``, for example). With
    ``scope`` (a :class:`hvd_dssync.scope.Scope` of a process set) the plan is that of this rank's position
    in the set.

    Example::

        plan = make_plan(num_groups=2, seed=0)
        plan.action(0)
    """
    if scope is not None and (topology is not None or schedule == "topology"):
        raise ValueError("Arg ``process_set``: schedule='topology' and ``topology`` are not supported inside a "
                         "process set (finding the hosts is a collective over all ranks); use 'shuffle' or "
                         "'butterfly'.")
    if isinstance(topology, str) and topology == "auto":  # sensed (once per job), or None for one rack
        topology = default_topology(schedule, num_groups, group_size, topology, schedule_options, scope is None)[0]
    options = dict(schedule_options or {})
    schedule, num_groups, group_size = resolve_schedule(schedule, num_groups, group_size, topology)
    if topology is not None or schedule == "topology":
        topology = job_topology(topology)
    rank, size = (hvd.rank(), hvd.size()) if scope is None else (scope.rank, scope.world_size)
    plan = SyncPlan(rank, size, schedule=schedule, num_groups=num_groups, group_size=group_size,
                    seed=seed, topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                    average_every=average_every, schedule_options=options, adaptive=adaptive)
    if plan.schedule.window_steps is not None:
        raise ValueError(
            f"hvd_dssync.keras: schedule {plan.schedule!r} changes its groups every "
            f"{plan.schedule.window_steps} steps (window_steps), but a traced graph keeps the process sets "
            "it was traced with. Use a schedule with one endless window (e.g. "
            "schedule_options={'window_steps': None} for 'shuffle', or 'butterfly').")
    return plan
