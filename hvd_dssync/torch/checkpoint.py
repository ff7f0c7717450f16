"""DS-Sync's part of the PyTorch optimizer's checkpoint: ``state_dict()["dssync"]``.

It carries the step (so that a resumed job continues the schedule where it stopped), the plan's configuration
and the arguments it was built with (its :class:`hvd_dssync.config.SyncConfig`'s
:meth:`~hvd_dssync.config.SyncConfig.plan_data`, checked on loading), the adaptive policy's state, the
sparse rows in play, the outer momentum and what an exact bridge left to carry into the next average.
"""
__all__ = ["dssync_state", "check_dssync_state", "load_dssync_state"]


def dssync_state(step, plan, config, averaging, sparse, sensed=None):
    """The ``"dssync"`` entry of the optimizer's ``state_dict()`` at ``step``, from its ``plan``, the
    :class:`hvd_dssync.config.SyncConfig` it was built with and its averaging and sparse rows; call it with
    no averaging in flight. ``sensed`` (the optimizer's ``sensed`` dict, or None): racks that were measured
    are the network's of the day, so a job resumed on racks measured otherwise may load the state.

    Example::

        state = super().state_dict()
        state["dssync"] = dssync_state(step, plan, config, averaging, sparse)
    """
    state = {"sync_step": step, "config": plan.config(), "arguments": config.plan_data()}
    if _measured(sensed):
        state["sensed"] = "measured"
    if plan.adaptive is not None:
        state["adaptive"] = plan.adaptive.state()
    if sparse.enabled:
        # None: no sets yet, every rank's model is the same; else this rank's rows that may differ.
        state["sparse_rows"] = sparse.state()
    outer = averaging.outer.state()
    if outer is not None:
        state["outer"] = outer
    carry = averaging.carry_state()
    if carry is not None:
        state["bridge_carry"] = carry
    return state


def _measured(sensed):
    return sensed is not None and sensed.get("how") == "measured"


def check_dssync_state(saved, plan, config, sensed=None):
    """Raise a ``ValueError`` if ``saved`` cannot be loaded into an optimizer with ``plan`` and ``config`` (see
    :func:`load_dssync_state`); returns whether it was saved with the same schedule in a world of the same
    size. Where both the saved optimizer and this one (``sensed``) measured their racks, the schedules may
    differ: the racks are the network's (:mod:`hvd_dssync.resense`), and this optimizer's stand."""
    same_world = saved["config"]["schedule"].get("world_size") == plan.world_size
    if same_world and saved["config"] != plan.config() and saved.get("sensed") == "measured" and _measured(sensed):
        return False
    if same_world and saved["config"] != plan.config():
        raise ValueError(f"the checkpoint's DS-Sync configuration {saved['config']} differs from "
                         f"this optimizer's {plan.config()}; resume with the same arguments.")
    mine = config.plan_data()
    if not same_world and saved.get("arguments") != mine:
        raise ValueError(f"the checkpoint's DS-Sync arguments {saved.get('arguments')} differ from "
                         f"this optimizer's {mine}; resume with the same arguments.")
    return same_world


def load_dssync_state(saved, plan, config, averaging, sparse, sensed=None):
    """Check ``saved`` (a ``"dssync"`` entry) against the optimizer's ``plan`` and ``config``, load its state
    into the plan's adaptive policy, ``averaging`` and ``sparse``, and return its step; call it with no
    averaging in flight.

    A state saved in a world of the same size must have the same schedule configuration; one saved in a
    world of another size (elastic Horovod, or a job restarted on more or fewer ranks) must have been built
    with the same arguments, and the schedule is that of the current world.

    Example::

        saved = state_dict.pop("dssync", None)
        if saved is not None:
            step = load_dssync_state(saved, plan, config, averaging, sparse)
    """
    same_world = check_dssync_state(saved, plan, config, sensed)
    if plan.adaptive is not None and "adaptive" in saved:
        plan.adaptive.load(saved["adaptive"])
    averaging.outer.load(saved.get("outer"))
    # Another world (or racks measured otherwise) has other racks: its bridges' carries mean nothing here.
    averaging.load_carry_state(saved.get("bridge_carry") if same_world else None)
    # A checkpoint without sets (sparse averaging off when it was saved): every row may differ.
    sparse.load(saved.get("sparse_rows", {}))
    return int(saved["sync_step"])
