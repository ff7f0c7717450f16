"""One training step's synchronization, decided the same way for every adapter.

:class:`SyncPlan` joins a schedule and a policy: for step ``t`` it says what to do (bulk-synchronous
gradient allreduce, group average, global average, or a local step), with which group, and which process
sets must be registered first. It also checks, with one allgather done by the adapter, that all ranks
were configured alike, naming the argument and the values where they were not.
"""
import hashlib
import json
from typing import NamedTuple

import numpy as np

from .adaptive import AdaptivePolicy, AdaptiveState
from .config import SyncConfig
from .resolution import arguments_for_world, build_schedule, default_group_size, resolve_schedule
from .policy import BSP, GLOBAL, GROUP, LOCAL, Policy
from .scope import scope_of

__all__ = ["SyncPlan", "Action", "ring_allreduce_bytes", "default_group_size", "resolve_schedule",
           "agreement_fields", "agreement_payload", "check_agreement", "check_horovod_arguments", "arguments_for_world",
           "routes_global_averages"]


class Action(NamedTuple):
    """What one step does: ``kind`` is BSP, GROUP, GLOBAL or LOCAL; ``group`` the ranks that average together.

    Example::

        >>> SyncPlan(rank=2, world_size=4, schedule="butterfly").action(0)
        Action(kind='group', group=(2, 3))
    """
    kind: str      # BSP, GROUP, GLOBAL or LOCAL
    group: tuple   # the ranks taking part (all ranks for BSP and GLOBAL, this rank alone for LOCAL)


def ring_allreduce_bytes(group_size, nbytes):
    """Bytes each rank sends in a ring allreduce of ``nbytes`` over ``group_size`` ranks.

    Example::

        >>> ring_allreduce_bytes(4, 1000), ring_allreduce_bytes(1, 1000)
        (1500, 0)
    """
    return 0 if group_size <= 1 else 2 * (group_size - 1) * nbytes // group_size


class SyncPlan:
    """The schedule and policy of one optimizer, seen from one rank.

    Args:
        rank, world_size: this rank and the number of ranks.
        schedule: a name in ``SCHEDULE_NAMES`` or a schedule object (see :func:`make_schedule`).
        num_groups, group_size, seed, topology, schedule_options: passed to :func:`make_schedule`; a
            "shuffle" given neither ``num_groups`` nor ``group_size`` takes :func:`default_group_size`.
        warmup_steps, global_every, average_every: the :class:`Policy`.
        adaptive: an :class:`hvd_dssync.adaptive.AdaptivePolicy` or its ``config()``: the kind of each step
            after the warm-up then follows the decisions in ``self.adaptive`` (an ``AdaptiveState``).

    Example::

        >>> plan = SyncPlan(rank=1, world_size=4, schedule="butterfly", warmup_steps=1, global_every=3)
        >>> [(a.kind, a.group) for a in map(plan.action, range(5))]  # doctest: +NORMALIZE_WHITESPACE
        [('bsp', (0, 1, 2, 3)), ('group', (1, 3)), ('group', (0, 1)), ('global', (0, 1, 2, 3)),
         ('group', (1, 3))]
        >>> plan.window_change(0)  # (groups to register, groups to release) when a window starts
        (((0, 1), (0, 2), (1, 3), (2, 3)), ())
    """

    def __init__(self, rank, world_size, schedule="shuffle", num_groups=None, group_size=None, seed=0,
                 topology=None, warmup_steps=0, global_every=0, average_every=1, schedule_options=None,
                 adaptive=None):
        self.rank = rank
        self.world_size = world_size
        self.world = tuple(range(world_size))
        self.policy = Policy(warmup_steps=warmup_steps, global_every=global_every, average_every=average_every)
        self.schedule = build_schedule(world_size, schedule, num_groups, group_size, seed, topology, schedule_options)
        if self.schedule.meets_only_in_global_averages and not global_every and adaptive is None:
            raise ValueError("Arg ``schedule_options``: intra_steps=None has no bridge step, so the racks meet only "
                             "in global averages, but ``global_every`` is 0; pass global_every (for example 32, "
                             "with average_every=8 and global_via_bridges=True).")
        self._window = None
        self.adaptive = None
        if adaptive is not None:
            adaptive = AdaptivePolicy.resolve(adaptive, average_every, global_every)
            self.adaptive = AdaptiveState(
                adaptive, warmup_steps, crosses=lambda step: self.schedule.crosses(self.schedule.group_of(rank, step)),
                first_average=first_crossing(self.schedule, warmup_steps, adaptive.first_averages()))

    @classmethod
    def from_config(cls, rank, world_size, config):
        """The plan of ``rank`` among ``world_size`` ranks for a :class:`hvd_dssync.config.SyncConfig`
        (its :meth:`~hvd_dssync.config.SyncConfig.plan_arguments`).

        Example::

            >>> from hvd_dssync.config import SyncConfig
            >>> SyncPlan.from_config(1, 4, SyncConfig(schedule="butterfly")).action(0)
            Action(kind='group', group=(0, 1))
        """
        if not isinstance(config, SyncConfig):
            raise TypeError(f"Arg ``config`` must be a SyncConfig, got {type(config).__name__}.")
        return cls(rank, world_size, **config.plan_arguments())

    def _schedule_step(self, step):
        return (self.adaptive or self.policy).schedule_step(step)

    def action(self, step):
        kind = (self.adaptive or self.policy).action(step)
        if kind == GROUP:
            return Action(GROUP, self.schedule.group_of(self.rank, self._schedule_step(step)))
        if kind == LOCAL:
            return Action(LOCAL, (self.rank,))
        return Action(kind, self.world)

    def change_period(self, step, average_every):
        """Average in groups every ``average_every`` steps (a divisor or a multiple of the period in force) from the
        first start of a period of both from ``step`` on, the first step not taken yet
        (:meth:`hvd_dssync.policy.Policy.with_period`), as the default's trial asks where it probes whether the
        racks' averages hide (:mod:`hvd_dssync.rhythm`). Every rank calls it with the same arguments. Returns that
        first step.

        Example::

            >>> plan = SyncPlan(rank=0, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]],
            ...                 average_every=8, global_every=32)
            >>> plan.change_period(40, 4), [plan.action(t).kind for t in (43, 51, 55, 63)]
            (40, ['group', 'group', 'group', 'global'])
            >>> plan.change_period(60, 8), [plan.action(t).kind for t in (67, 71, 79)], plan.config()["policy"]
            (64, ['local', 'group', 'group'], {'warmup_steps': 0, 'global_every': 32, 'average_every': 8})
        """
        if self.adaptive is not None:
            raise ValueError("the adaptive policy chooses its own periods")
        self.policy = self.policy.with_period(step, average_every)
        return self.policy.since[0]

    def bridge(self, step):
        """How this rank averages at ``step`` when it crosses the racks on an exact bridge
        (:class:`hvd_dssync.schedules.Bridge`), else ``None``. What the adapters do with it: scale what
        they send by ``scale``, then keep ``carry`` times the move of the average and add it to what they
        send in their next group average (:func:`carry_fate`).

        Example::

            >>> plan = SyncPlan(rank=1, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]],
            ...                 average_every=2)
            >>> [plan.bridge(t) for t in range(8)][5:]
            [None, None, Bridge(scale=1.0, carry=1.0)]
        """
        if (self.adaptive or self.policy).action(step) != GROUP:
            return None
        return self.schedule.bridge(self.rank, self._schedule_step(step))

    def global_route(self, step):
        """How this rank takes part in the global average at ``step`` where it goes through the racks
        (:class:`hvd_dssync.schedules.GlobalRoute`: the topology-aware schedule's ``global_via_bridges``), else
        ``None`` (not a global step, or one average over every rank).

        Example::

            >>> plan = SyncPlan(rank=3, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]],
            ...                 average_every=4, global_every=8, schedule_options={"global_via_bridges": True})
            >>> [t for t in range(24) if plan.global_route(t)], plan.global_route(7)
            ([7, 15, 23], GlobalRoute(rack=(2, 3), group=(1, 3), speaks=True, scale=1.0))
        """
        if (self.adaptive or self.policy).action(step) != GLOBAL:
            return None
        return self.schedule.global_route(self.rank, self._schedule_step(step))

    def partition(self, step):
        """Every group that averages at ``step``, on any rank: the schedule's partition, all ranks together for
        a bulk-synchronous or global step, none for a local step. Where knowledge carried by the averages
        spreads (:mod:`hvd_dssync.join`).

        Example::

            >>> plan = SyncPlan(rank=0, world_size=4, schedule="butterfly", average_every=2)
            >>> [plan.partition(t) for t in range(4)]
            [(), ((0, 1), (2, 3)), (), ((0, 2), (1, 3))]
        """
        kind = (self.adaptive or self.policy).action(step)
        if kind == GROUP:
            return self.schedule.groups(self._schedule_step(step))
        if kind == LOCAL:
            return ()
        return (self.world,)

    def window_change(self, step):
        """``(acquire, release)`` group lists when ``step`` enters a new window, else ``None``.

        Call once per step on every rank, before the step's communication; it remembers the window.
        """
        window = self.schedule.window_of(self._schedule_step(step))
        if window == self._window:
            return None
        acquire = self.schedule.window_groups(window)
        release = () if self._window is None else self.schedule.window_groups(self._window)
        self._window = window
        return acquire, release

    def leave_window(self):
        """The groups of the window in force (none before the first), which the optimizer releases when it
        follows another plan from now on (a changed network: :mod:`hvd_dssync.resense`).

        Example::

            >>> plan = SyncPlan(rank=0, world_size=4, schedule="butterfly")
            >>> plan.leave_window(), len(plan.window_change(0)[0]), len(plan.leave_window())
            ((), 4, 4)
        """
        groups = () if self._window is None else self.schedule.window_groups(self._window)
        self._window = None
        return groups

    def config(self):
        config = {"schedule": self.schedule.config(), "policy": self.policy.config()}
        if self.adaptive is not None:
            config["adaptive"] = self.adaptive.policy.config()
        return config


def routes_global_averages(schedule, adapter, lossy_compression=False, adaptive=False, sparse=False,
                           overlapped=False):
    """Whether a schedule's global averages go through the racks (``global_via_bridges``) in this optimizer.

    Not where the schedule does not ask for it. Where it asks and the optimizer cannot honour it (the Keras
    adapter; a lossy compression, whose reference moves with one average over every rank; the adaptive
    policy, which times its global averages as one; sparse averaging, whose row sets are gathered over every
    rank): ``global_via_bridges=True`` raises a ``ValueError`` naming what stands in the way, ``"auto"`` (the
    default on racks in the PyTorch adapter) averages over every rank at once. With ``overlap=True``
    (``overlapped``) the route's three averages would each wait for the one before: ``"auto"`` averages over
    every rank at once, behind the next steps (:func:`hvd_dssync.overlap.folds_now`, in fragments where the
    optimizer says: :func:`hvd_dssync.fragments.global_fragments`); ``True`` keeps the
    route, waited for, while the group averages run behind the steps (the default's trial of overlap chooses
    between the two where it is "auto"). A pure function of its arguments: every rank decides or raises alike.
    No communication.

    Example::

        >>> from hvd_dssync.schedules import TopologyAware
        >>> from hvd_dssync.topology import Topology
        >>> racks = Topology.from_racks([[0, 1], [2, 3]])
        >>> t = TopologyAware(racks, global_via_bridges=True)
        >>> routes_global_averages(t, "PyTorch"), routes_global_averages(TopologyAware(racks), "PyTorch")
        (True, False)
        >>> routes_global_averages(TopologyAware(racks, global_via_bridges="auto"), "PyTorch", sparse=True)
        False
        >>> routes_global_averages(TopologyAware(racks, global_via_bridges="auto"), "PyTorch", overlapped=True)
        False
        >>> routes_global_averages(t, "PyTorch", overlapped=True)  # asked for: the route, waited for
        True
        >>> routes_global_averages(t, "PyTorch", adaptive=True)
        Traceback (most recent call last):
        ...
        ValueError: Arg ``schedule_options``: global_via_bridges=True cannot be honoured with policy="adaptive"; ...
    """
    asked = schedule.global_via_bridges
    if not asked:
        return False
    beside = [what for what, given in (("a lossy compression", lossy_compression), ('policy="adaptive"', adaptive),
                                      ("sparse_average", sparse)) if given]
    if adapter != "PyTorch":
        beside.insert(0, f"the {adapter} adapter (PyTorch's only)")
    if beside and asked is True:
        raise ValueError(f"Arg ``schedule_options``: global_via_bridges=True cannot be honoured with "
                         f"{' or '.join(beside)}; its global averages go through the racks in three averages, "
                         'waited for. Leave it out (or pass "auto") to average over every rank at once there.')
    return not beside and not (overlapped and asked == "auto")


def carry_fate(kind):
    """What a bridge's carry (:meth:`SyncPlan.bridge`) waiting on a rank does at a step of ``kind``: "add" it
    to what the rank sends (a group average: the rank's next group follows the bridge's move), "drop" it (a
    global or bulk-synchronous step reaches the average of all ranks on its own) or "keep" it (a local step).

    Example::

        >>> carry_fate(GROUP), carry_fate(GLOBAL), carry_fate(LOCAL)
        ('add', 'drop', 'keep')
    """
    return {GROUP: "add", LOCAL: "keep"}.get(kind, "drop")


def first_crossing(schedule, warmup_steps, averages, horizon=256):
    """The schedule's step, counted from ``warmup_steps``, at which an adaptive policy's first window of
    ``averages`` averages should start so that its last average crosses the racks (a bridge step of the
    topology-aware schedule): the first decision then has a crossing's cost to go on (see
    :func:`hvd_dssync.adaptive.decide`). 0 where no step within ``horizon`` crosses (a schedule that knows
    no racks). No communication.

    Example::

        >>> from hvd_dssync.schedules import TopologyAware
        >>> from hvd_dssync.topology import Topology
        >>> t = TopologyAware(Topology.from_racks([[0, 1], [2, 3]]), intra_steps=3)  # the bridge: steps 3, 7, ...
        >>> first_crossing(t, 0, 2), first_crossing(t, 0, 4), first_crossing(t, 5, 1)
        (2, 0, 2)
    """
    for start in range(horizon):
        crossing = [schedule.crosses(group) for group in schedule.groups(warmup_steps + start + averages - 1)]
        if None in crossing:  # the schedule knows no racks
            return 0
        if any(crossing):
            return start
    return 0


def check_horovod_arguments(hvd, op, gradient_predivide_factor, backward_passes_per_step, process_set):
    """Validate the arguments both adapters take from Horovod's ``DistributedOptimizer``.

    ``hvd`` is the framework's Horovod module (for its op constants and global process set). Raises
    before any communication, with a message naming the argument and the rule. Returns the ranks DS-Sync
    runs among, a :class:`hvd_dssync.scope.Scope`: the whole job, or ``process_set``'s ranks.

    Example::

        scope = check_horovod_arguments(hvd, hvd.Average, 1.0, 1, hvd.global_process_set)  # the whole job
    """
    if op == hvd.Adasum:
        raise ValueError("Arg ``op=hvd.Adasum`` has no meaning under DS-Sync, which averages models "
                         "within groups; use op=hvd.Average.")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"Arg ``op`` must be hvd.Average or hvd.Sum (for the warm-up's gradients), got {op!r}.")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("Arg ``gradient_predivide_factor`` is only supported with op=hvd.Average.")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"Arg ``backward_passes_per_step`` must be a positive integer, got "
                         f"{backward_passes_per_step!r}.")
    return scope_of(hvd, process_set)


def _digest(value):
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha256(text).hexdigest()[:12]


def _groups_sample(schedule):
    """The groups of the first steps of the first windows: what the ranks must compute alike.

    Two ranks with equal arguments can still draw different groups (NumPy does not promise the same
    random stream across versions), so the agreement check compares the groups themselves.
    """
    windows = (0,) if schedule.window_steps is None else (0, 1, 2)
    steps = [schedule.window_start(w) + i for w in windows for i in range(8)]
    return [schedule.groups(t) for t in steps]


_LARGE = 120  # characters: a value longer than this is compared and shown by its digest


def agreement_fields(plan, parameters=None, options=None, step=None):
    """What the ranks must agree on, as ``{argument: value}``, for :func:`agreement_payload`.

    ``plan`` is the rank's :class:`SyncPlan`; ``parameters`` the averaged tensors as
    ``(name, shape, dtype)`` (compared by digest); ``options`` the adapter's own arguments by name;
    ``step`` rides along uncompared (an elastic newcomer takes rank 0's).

    Example::

        >>> fields = agreement_fields(SyncPlan(0, 4, num_groups=2, seed=3))
        >>> fields["seed"], fields["num_groups"], fields["average_every"]
        (3, 2, 1)
    """
    fields = {"world size": plan.world_size}
    config = plan.schedule.config()
    fields["schedule"] = config.pop("name", type(plan.schedule).__name__)
    config.pop("world_size", None)
    fields.update(config)
    fields.update(plan.policy.config())
    if plan.adaptive is not None:
        fields["adaptive"] = plan.adaptive.policy.config()
    fields["groups"] = _digest(_groups_sample(plan.schedule))
    if parameters is not None:
        parameters = [list(p) for p in parameters]
        fields["parameters"] = f"{len(parameters)} tensors, digest {_digest(parameters)}"
    fields.update(options or {})
    for key, value in fields.items():
        if len(json.dumps(value, default=str)) > _LARGE:
            fields[key] = f"digest {_digest(value)}"
    if step is not None:
        fields["step"] = int(step)
    return fields


_UNCOMPARED = ("step",)


def agreement_payload(fields):
    """``fields`` (from :func:`agreement_fields`) as a uint8 vector for an allgather across ranks.

    Each rank's vector is its JSON text after an 8-byte length, so the concatenation that Horovod's
    allgather returns (vectors of different lengths) can be split again by :func:`check_agreement`.

    Example::

        >>> agreement_payload({"seed": 0}).dtype
        dtype('uint8')
    """
    text = json.dumps(fields, default=str).encode()
    return np.frombuffer(len(text).to_bytes(8, "little") + text, dtype=np.uint8).copy()


def _split(gathered):
    data, out, at = np.asarray(gathered, dtype=np.uint8).tobytes(), [], 0
    while at < len(data):
        size = int.from_bytes(data[at:at + 8], "little")
        out.append(json.loads(data[at + 8:at + 8 + size]))
        at += 8 + size
    return out


def _show(value):
    return value if isinstance(value, str) else repr(value)


def check_agreement(gathered, what="hvd_dssync"):
    """Raise the same ``ValueError`` on every rank if the ranks' gathered fields differ; else return them.

    ``gathered`` is the concatenation of every rank's :func:`agreement_payload`, in rank order (what
    Horovod's allgather gives every rank). The message names each differing argument and the values of
    rank 0 and of the ranks that differ from it. Returns the list of every rank's fields.

    Example::

        >>> a, b = agreement_payload({"seed": 0}), agreement_payload({"seed": 1})
        >>> check_agreement(np.concatenate([a, b]))
        Traceback (most recent call last):
        ...
        ValueError: hvd_dssync: ranks disagree on seed (rank 0 has 0, rank 1 has 1). ...
    """
    ranks = _split(gathered)
    problems = []
    keys = list(ranks[0]) + sorted({k for r in ranks[1:] for k in r} - set(ranks[0]))
    for key in (k for k in keys if k not in _UNCOMPARED):
        values = [r.get(key, "(absent)") for r in ranks]
        differ = [i for i, v in enumerate(values) if v != values[0]]
        if differ:
            shown = [0] + differ[:3]
            more = f" and {len(differ) - 3} more ranks" if len(differ) > 3 else ""
            problems.append(f"{key} (" + ", ".join(f"rank {i} has {_show(values[i])}" for i in shown) + more + ")")
    if len(problems) > 1:  # the groups follow from the arguments: named alone, they differ by NumPy
        problems = [p for p in problems if not p.startswith("groups (")]
    if problems:
        raise ValueError(f"{what}: ranks disagree on {'; '.join(problems)}. Every rank must build the optimizer "
                         "with the same arguments and the same model, with the same hvd_dssync and NumPy.")
    return ranks


def check_ranks_agree(allgather, plan, parameters=None, options=None, what="hvd_dssync", step=None):
    """The ranks' agreement check both adapters run: one allgather of every rank's :func:`agreement_fields`,
    then :func:`check_agreement` (the same ``ValueError`` on every rank, naming what differs). A collective.

    ``allgather(payload)`` allgathers this rank's uint8 vector in the adapter's framework over the
    optimizer's ranks and returns the concatenation as a NumPy array. Returns every rank's fields (with
    ``step``, rank 0's step is ``ranks[0]["step"]``).

    Example::

        >>> plan = SyncPlan(0, 1, num_groups=1)
        >>> check_ranks_agree(lambda payload: payload, plan, step=3)[0]["step"]
        3
    """
    mine = agreement_payload(agreement_fields(plan, parameters, options, step=step))
    return check_agreement(allgather(mine), what=what)


__all__ += ["carry_fate", "first_crossing", "BSP", "GLOBAL", "GROUP", "LOCAL"]
