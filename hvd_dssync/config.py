"""DS-Sync's own arguments in one object, validated once, and how they resolve into a schedule.

:class:`SyncConfig` holds the arguments that both adapters' ``DistributedOptimizer`` take for DS-Sync
(not Horovod's, not the model): it checks them when it is built, before any communication, naming the
argument; :meth:`SyncConfig.resolve` settles the racks and the default schedule (both adapters call it the
same way). The optimizer keeps the result as one object: its plan is built from it
(``SyncPlan.from_config``), checkpoints record it (:meth:`SyncConfig.plan_data`; :meth:`SyncConfig.to_dict`
turns it all into plain data), and an elastic change of world follows it (:meth:`SyncConfig.for_world`).

The schedule arguments resolve the same way for every caller (:mod:`hvd_dssync.resolution`), and
:func:`default_average_every` chooses the default period: pure functions of their arguments, so every rank
decides alike, without communicating.
"""
import warnings
from dataclasses import dataclass, fields, replace

from .adaptive import AdaptivePolicy
from .policy import Policy
from .resolution import (_check_schedule, _is_auto, arguments_for_world, build_schedule,
                         refuse_topology_in_process_set, resolve_schedule)
from .sensing import AUTO, Sensed, names_schedule
from .topology import Topology

__all__ = ["SyncConfig", "config_of", "HorovodArgumentWarning", "warn_num_groups", "default_average_every",
           "default_rack_rhythm", "quickens_racks", "RACK_AVERAGE_EVERY", "RACK_GLOBAL_EVERY", "FLAT_AVERAGE_EVERY"]

# ``average_every`` where DS-Sync picks the schedule itself and it is the topology-aware one (racks sensed or
# given): a rack's average every this many steps, local steps between (docs/tuning.md has the measurements).
RACK_AVERAGE_EVERY = 8
# ``global_every`` there: every rank averages together every this many steps, and the racks meet only then
# (no bridge steps, ``intra_steps=None``); docs/tuning.md has the measurements.
RACK_GLOBAL_EVERY = 32
# ``average_every`` where the optimizer sensed several hosts on one flat network and averages over every rank
# (post-local SGD): docs/tuning.md has the measurements.
FLAT_AVERAGE_EVERY = 8


def _picks_the_rhythm(schedule_given, policy):
    """Whether DS-Sync chooses the periods itself: no schedule was named (the one-line swap) and the policy
    is the fixed one (the adaptive policy chooses its own)."""
    fixed = policy is None or (isinstance(policy, str) and policy == "fixed")
    return schedule_given is None and fixed


def default_average_every(average_every, schedule_given, schedule, policy=None, flat_hosts=False):
    """``average_every`` as given, or its default (``None``) under the fixed policy where the schedule was not
    named (``schedule_given`` None, the one-line swap): :data:`RACK_AVERAGE_EVERY` where it resolved to the
    topology-aware one (racks sensed or given), :data:`FLAT_AVERAGE_EVERY` where the optimizer sensed hosts on
    one flat network (``flat_hosts``: one group of every rank); else 1. A pure function: every rank decides
    alike.

    Example::

        >>> default_average_every(None, None, "topology"), default_average_every(None, "topology", "topology")
        (8, 1)
        >>> default_average_every(None, None, "shuffle"), default_average_every(2, None, "topology")
        (1, 2)
        >>> default_average_every(None, None, "shuffle", flat_hosts=True)
        8
    """
    if average_every is not None:
        return average_every
    if not _picks_the_rhythm(schedule_given, policy):
        return 1
    if schedule == "topology":
        return RACK_AVERAGE_EVERY
    return FLAT_AVERAGE_EVERY if flat_hosts else 1


def quickens_racks(average_every, schedule_given, schedule, policy=None):
    """Whether the default's trial may halve the racks' period where their averages hide
    (:mod:`hvd_dssync.rhythm`): ``average_every`` was not given and DS-Sync picked the rhythm on racks
    (:func:`default_average_every`'s :data:`RACK_AVERAGE_EVERY`). A period given is kept.

    Example::

        >>> quickens_racks(None, None, "topology"), quickens_racks(8, None, "topology")
        (True, False)
        >>> quickens_racks(None, None, "shuffle"), quickens_racks(None, "topology", "topology")
        (False, False)
    """
    return average_every is None and _picks_the_rhythm(schedule_given, policy) and schedule == "topology"


def default_rack_rhythm(global_every, schedule_options, schedule_given, schedule, policy=None, routes=True):
    """``global_every`` and ``schedule_options`` as given, or their defaults under the fixed policy where the
    schedule was not named and resolved to the topology-aware one (the one-line swap on racks): ``global_every``
    None becomes :data:`RACK_GLOBAL_EVERY`, and, where there are then global averages, the options not named
    become: the racks meet only in them (``intra_steps=None``: no bridge steps; the global average is exact,
    the bridges' average of two racks' means is not), and, where the adapter ``routes`` (PyTorch's), they go
    through the racks where nothing stands in the way (``global_via_bridges="auto"``: one model over the slow
    link each way, on groups that need no negotiation; :func:`hvd_dssync.plan.routes_global_averages`).
    Elsewhere None is 0 and the options stay as given. A pure function: every rank decides alike.

    Example::

        >>> default_rack_rhythm(None, None, None, "topology")
        (32, {'intra_steps': None, 'global_via_bridges': 'auto'})
        >>> default_rack_rhythm(None, None, None, "topology", routes=False)  # the Keras adapter
        (32, {'intra_steps': None})
        >>> default_rack_rhythm(0, None, None, "topology")  # no global averages: the bridges' steps stay
        (0, None)
        >>> default_rack_rhythm(None, {"intra_steps": 3, "global_via_bridges": False}, None, "topology")
        (32, {'intra_steps': 3, 'global_via_bridges': False})
        >>> default_rack_rhythm(None, None, "topology", "topology"), default_rack_rhythm(None, None, None, "shuffle")
        ((0, None), (0, None))
    """
    if not _picks_the_rhythm(schedule_given, policy) or schedule != "topology":
        return (0 if global_every is None else global_every), schedule_options
    every = RACK_GLOBAL_EVERY if global_every is None else global_every
    if every:
        defaults = {"intra_steps": None, **({"global_via_bridges": "auto"} if routes else {})}
        schedule_options = {**defaults, **(schedule_options or {})}
    return every, schedule_options


def _flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"Arg ``{name}`` must be True or False, got {value!r}.")


# The fields a plan is built from (SyncPlan's arguments, the policy aside).
_PLAN_KEYS = ("schedule", "num_groups", "group_size", "seed", "topology", "warmup_steps", "global_every",
              "average_every", "schedule_options")


def config_of(sync, keywords, in_process_set=False, unsupported=()):
    """The :class:`SyncConfig` an adapter's optimizer (or ``init``, ``add_process_set_groups``) uses:
    ``sync`` where given, else one built from DS-Sync's ``keywords`` (the adapter's keyword arguments,
    named as the fields). With ``sync`` every keyword must keep its default: a value is given in one place.
    ``unsupported`` names fields the adapter cannot act on; ``sync`` must leave them at their default or
    off. The topology-aware schedule is refused inside a process set first
    (:func:`refuse_topology_in_process_set`). No communication: every rank raises alike.

    Example::

        >>> config_of(None, {"num_groups": 2, "seed": 1}).num_groups
        2
        >>> config_of(SyncConfig(seed=7), {"seed": 0, "num_groups": None}).seed
        7
        >>> config_of(SyncConfig(seed=7), {"seed": 3})
        Traceback (most recent call last):
        ...
        ValueError: Arg ``sync`` holds DS-Sync's arguments; pass them there or as keywords, not both (got ``seed``).
        >>> config_of(SyncConfig(outer_momentum=0.5), {}, unsupported=("outer_momentum",))
        Traceback (most recent call last):
        ...
        ValueError: Arg ``sync``: outer_momentum=0.5 is not supported by this adapter (PyTorch's only).
    """
    if sync is None:
        refuse_topology_in_process_set(in_process_set, keywords.get("schedule"), keywords.get("topology", AUTO))
        return SyncConfig(**keywords)
    if not isinstance(sync, SyncConfig):
        raise TypeError(f"Arg ``sync`` must be a hvd_dssync.SyncConfig or None, got {type(sync).__name__}.")
    defaults = {f.name: f.default for f in fields(SyncConfig)}
    given = [name for name, value in keywords.items() if not _is_default(value, defaults[name])]
    if given:
        raise ValueError("Arg ``sync`` holds DS-Sync's arguments; pass them there or as keywords, not both "
                         f"(got {', '.join(f'``{name}``' for name in given)}).")
    for name in unsupported:
        value = getattr(sync, name)
        if value:  # 0.0 (or None) is off where the adapter has no such thing
            raise ValueError(f"Arg ``sync``: {name}={value!r} is not supported by this adapter (PyTorch's only).")
    refuse_topology_in_process_set(in_process_set, sync.schedule, sync.topology)
    return sync


class HorovodArgumentWarning(UserWarning):
    """A Horovod argument that the swapped ``DistributedOptimizer`` reads otherwise than Horovod does
    (:func:`warn_num_groups`).

    Example::

        import warnings
        warnings.simplefilter("error", hvd_dssync.HorovodArgumentWarning)  # a script that must not be misread
    """


def warn_num_groups(num_groups, stacklevel=3):
    """Warn where ``num_groups`` reached an adapter's ``DistributedOptimizer`` as a keyword: Horovod's
    (deprecated) count of fusion groups there, DS-Sync's groups a step here (docs/faq.md says why), so a Horovod
    script that passed it for fusion changes its synchronization. Given through ``sync=SyncConfig(...)``, the
    count is DS-Sync's beyond doubt and nobody is warned. Every rank warns alike; no communication.

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_num_groups(2, stacklevel=1); warn_num_groups(0, stacklevel=1)
        >>> [w.category.__name__ for w in caught]
        ['HorovodArgumentWarning']
    """
    if num_groups:
        warnings.warn(
            f"hvd_dssync: num_groups={num_groups!r} is DS-Sync's number of groups a step, not Horovod's (deprecated) "
            f"count of fusion groups, and it replaces the default schedule: drop it if the script passed it for "
            f"Horovod's fusion; to choose DS-Sync's groups without this warning, pass "
            f"sync=hvd_dssync.SyncConfig(num_groups={num_groups!r}) or group_size=.",
            HorovodArgumentWarning, stacklevel=stacklevel)


def _is_default(value, default):
    return value is default or (type(value) is type(default) and value == default)


@dataclass(frozen=True)
class SyncConfig:
    """DS-Sync's own arguments of one optimizer, validated when built; the errors name the argument.

    The fields are the keyword arguments both adapters' ``DistributedOptimizer`` take for DS-Sync, with
    their defaults (the Keras adapter's ``average_non_trainable`` is ``average_buffers`` here; ``outer_momentum``
    acts in the PyTorch adapter only, and the Keras adapter refuses it; ``overlap=None`` runs a trial in either
    where the averages cross hosts, :func:`hvd_dssync.overlap.runs_trial`). Build one,
    and pass the same object as ``sync=`` to either adapter's ``DistributedOptimizer``, ``init`` and
    ``add_process_set_groups``: one place for each value (:func:`config_of`). ``schedule`` is a name in
    ``SCHEDULE_NAMES``, a schedule object, or None (resolved by :func:`resolve_schedule`); ``topology`` is
    racks, a :class:`hvd_dssync.topology.Topology`, None, or "auto" (sensed by :meth:`resolve`); ``policy`` is
    None, "fixed", "adaptive", an :class:`hvd_dssync.adaptive.AdaptivePolicy` or its ``config()``.
    Conflicting arguments are refused: ``num_groups`` with ``group_size``, ``num_groups`` with
    "butterfly", either with the topology-aware schedule, ``global_every`` with the adaptive policy.
    The errors are the plan's and the schedules' own, raised before any communication; what needs the world
    size (``num_groups`` above it, a schedule object's partitions) is checked when the plan is built
    (:meth:`schedule_for`, :meth:`hvd_dssync.plan.SyncPlan.from_config`).

    Both adapters build their optimizer's configuration alike: ``SyncConfig(...)`` from the arguments, then
    :meth:`resolve` (the racks and the default schedule); the optimizer keeps the result, builds its plan
    from it, compares it across ranks, writes it in checkpoints (:meth:`plan_data`) and follows a change of
    world with :meth:`for_world`.

    Example::

        >>> config = SyncConfig(num_groups=2, seed=3, average_every=2)
        >>> config.plan_arguments()["num_groups"], config.to_dict()["seed"]
        (2, 3)
        >>> SyncConfig.from_dict(config.to_dict()) == config
        True
        >>> config.for_world(1).num_groups
        1
        >>> SyncConfig(num_groups=2, group_size=2)
        Traceback (most recent call last):
        ...
        ValueError: Pass exactly one of ``num_groups`` and ``group_size`` (got num_groups=2, group_size=2).
        >>> SyncConfig() == SyncConfig(topology="auto", overlap=None)  # the optimizers' defaults
        True
    """
    num_groups: object = None
    group_size: object = None
    seed: int = 0
    schedule: object = None
    topology: object = AUTO
    warmup_steps: int = 0
    global_every: object = None
    average_every: object = None
    schedule_options: object = None
    policy: object = None
    outer_momentum: float = 0.0
    overlap: object = None  # True, False, or None: decided by a trial (hvd_dssync.overlap)
    average_buffers: bool = True
    sparse_average: bool = True

    def __post_init__(self):
        # In the order the plan checks them: the policies, the schedule's resolution, the schedule.
        AdaptivePolicy.resolve(self.policy, self._every, self._global)
        Policy(warmup_steps=self.warmup_steps, global_every=self._global, average_every=self._every)
        racks = None if _is_auto(self.topology) else self.topology
        resolved = resolve_schedule(self.schedule, self.num_groups, self.group_size, racks)[0]
        _check_schedule(self.schedule, resolved, self.num_groups, self.group_size, self.seed)
        if self.schedule_options is not None:
            if not isinstance(self.schedule_options, dict):
                raise ValueError(f"Arg ``schedule_options`` must be a dict or None, got {self.schedule_options!r}.")
            object.__setattr__(self, "schedule_options", dict(self.schedule_options))
        momentum = self.outer_momentum
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"Arg ``outer_momentum`` must be a number in [0, 1), got {momentum!r}.")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"Arg ``overlap`` must be True, False or None (decided by a trial), got {self.overlap!r}.")
        for name in ("average_buffers", "sparse_average"):
            _flag(name, getattr(self, name))

    def resolve(self, sense, job_topology, in_process_set=False, routes=True):
        """This configuration as an optimizer keeps it, with what was sensed: ``(config, Sensed or None)``.

        ``sense(schedule, num_groups, group_size, topology, schedule_options, whole_job)`` is the adapter's
        :func:`hvd_dssync.sensing.default_topology`: ``topology="auto"`` becomes the sensed racks or None.
        Where it sensed several hosts and no racks (one flat network), the default is one group of every rank
        (``num_groups=1``): random groups gained nothing over Horovod's allreduce there and lost time to
        it on the bench (docs/tuning.md). The schedule is then resolved (:func:`resolve_schedule`: None becomes
        "topology" or "shuffle"), and
        ``average_every`` (:func:`default_average_every`: None becomes :data:`RACK_AVERAGE_EVERY` on the
        default's racks, :data:`FLAT_AVERAGE_EVERY` on a flat network of hosts, else 1), and
        racks, where there are any, become the job's :class:`hvd_dssync.topology.Topology` through
        ``job_topology(spec)`` (the adapter's allgather of host names). Inside a process set
        (``in_process_set``) the topology-aware schedule is refused (:func:`refuse_topology_in_process_set`).
        ``global_every`` None and the options of the default on racks: :func:`default_rack_rhythm` (``routes``:
        whether the adapter can send global averages through the racks; the Keras adapter cannot).
        Call it on every rank at the same point: sensing and ``job_topology`` are collectives.

        Example::

            config, sensed = SyncConfig(num_groups=2, topology="auto").resolve(sense, job_topology)
        """
        topology, sensed = sense(self.schedule, self.num_groups, self.group_size, self.topology,
                                 self.schedule_options, not in_process_set)
        num_groups = self.num_groups
        flat_hosts = isinstance(sensed, Sensed) and sensed.racks is None and sensed.hosts > 1
        if flat_hosts:
            num_groups = 1  # hosts on one flat network: every rank averages together
        schedule = resolve_schedule(self.schedule, num_groups, self.group_size, topology)[0]
        # The adapters refuse the arguments first; HVD_DSSYNC_TOPOLOGY may make the resolved schedule so.
        refuse_topology_in_process_set(in_process_set, schedule, topology)
        if topology is not None or schedule == "topology":
            topology = job_topology(topology)
        every = default_average_every(self.average_every, self.schedule, schedule, self.policy, flat_hosts)
        global_every, options = default_rack_rhythm(self.global_every, self.schedule_options, self.schedule,
                                                    schedule, self.policy, routes)
        return replace(self, schedule=schedule, topology=topology, average_every=every, num_groups=num_groups,
                       global_every=global_every, schedule_options=options), sensed

    def quickens_racks(self, resolved):
        """Whether the default's trial may halve the racks' period of ``resolved``, this configuration as
        :meth:`resolve` returned it: :func:`quickens_racks` of what was asked and the schedule it resolved to.

        Example::

            >>> SyncConfig().quickens_racks(SyncConfig(schedule="topology", average_every=8, topology=[[0, 1], [2, 3]]))
            True
        """
        return quickens_racks(self.average_every, self.schedule, resolved.schedule, self.policy)

    @property
    def _racks(self):
        """``topology``, with racks still to be sensed (``"auto"``, until :meth:`resolve`) as none."""
        return None if _is_auto(self.topology) else self.topology

    @property
    def _every(self):
        """``average_every``, with None (the default, until :meth:`resolve` chooses it) as every step."""
        return 1 if self.average_every is None else self.average_every

    @property
    def _global(self):
        """``global_every``, with None (the default, until :meth:`resolve` chooses it) as never."""
        return 0 if self.global_every is None else self.global_every

    def adaptive(self):
        """The :class:`hvd_dssync.adaptive.AdaptivePolicy` asked for, or ``None`` (the fixed policy)."""
        return AdaptivePolicy.resolve(self.policy, self._every, self._global)

    def plan_arguments(self):
        """The keyword arguments of :class:`hvd_dssync.plan.SyncPlan` (but ``rank`` and ``world_size``)."""
        arguments = {key: getattr(self, key) for key in _PLAN_KEYS}
        arguments["average_every"], arguments["topology"] = self._every, self._racks
        arguments["global_every"] = self._global
        adaptive = self.adaptive()
        if adaptive is not None:
            arguments["adaptive"] = adaptive.config()
        return arguments

    def plan_data(self):
        """:meth:`plan_arguments` as plain data (:meth:`to_dict`'s form): what a checkpoint records, and
        compares on resuming in a world of another size.

        Example::

            >>> SyncConfig(schedule="shuffle", group_size=2).plan_data()["group_size"]
            2
        """
        data = self.to_dict()
        out = {key: data[key] for key in _PLAN_KEYS}
        out["global_every"] = self._global
        if _is_auto(self.topology):
            out["topology"] = None
        adaptive = self.adaptive()
        if adaptive is not None:
            out["adaptive"] = adaptive.config()
        return out

    def schedule_for(self, world_size):
        """The schedule of these arguments for ``world_size`` ranks (:func:`build_schedule`); racks still to
        be sensed (``topology="auto"`` before :meth:`resolve`) count as none."""
        return build_schedule(world_size, self.schedule, self.num_groups, self.group_size, self.seed,
                              self._racks, self.schedule_options)

    def schedule_arguments(self):
        """The schedule's own arguments (``num_groups``, ``group_size``, ``seed``, ``schedule``,
        ``schedule_options``): what :func:`hvd_dssync.scope.process_set_groups` takes.

        Example::

            >>> SyncConfig(group_size=2, seed=1).schedule_arguments()["group_size"]
            2
        """
        return {key: getattr(self, key) for key in ("num_groups", "group_size", "seed", "schedule", "schedule_options")}

    def startup_schedule(self, world_size):
        """The schedule of these arguments for ``world_size`` ranks where it is known before Horovod starts
        (what ``hvd_dssync.torch.init`` registers then), else ``None``: the world size is unknown (``None``
        or 0), the racks are to be sensed (``topology="auto"`` and no argument names the schedule), or the
        topology-aware schedule has racks given otherwise than as ranks (host names in JSON or a file,
        ``HVD_DSSYNC_TOPOLOGY``, or none: one rack a host), which only the job can resolve. No communication.

        Example::

            >>> SyncConfig(schedule="butterfly").startup_schedule(4).every_group()
            ((0, 1), (0, 2), (1, 3), (2, 3))
            >>> SyncConfig(topology="auto").startup_schedule(4) is None, SyncConfig().startup_schedule(None)
            (True, None)
        """
        named = names_schedule(self.schedule, self.num_groups, self.group_size, self.schedule_options)
        if not world_size or (_is_auto(self.topology) and not named):  # "auto" senses where nothing names one
            return None
        schedule = resolve_schedule(self.schedule, self.num_groups, self.group_size, self._racks)[0]
        if schedule == "topology" and not isinstance(self._racks, (list, Topology)):
            return None
        return self.schedule_for(world_size)

    def for_world(self, world_size):
        """These arguments (resolved, :meth:`resolve`) for a world of ``world_size`` ranks after an elastic
        change (:func:`arguments_for_world`: sizes capped; a schedule object or a topology refused). The
        optimizer keeps its configuration as built and asks again at each change, so that a world that grows
        back gets its sizes back."""
        capped = arguments_for_world({"schedule": self.schedule, "num_groups": self.num_groups,
                                      "group_size": self.group_size, "topology": self._racks}, world_size)
        return replace(self, num_groups=capped["num_groups"], group_size=capped["group_size"])

    def to_dict(self):
        """Plain data (JSON-able) for checkpoints and the ranks' agreement: a schedule object by its
        ``config()``, a topology by its ``to_dict()``, an adaptive policy by its ``config()``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        schedule, topology, policy = self.schedule, self.topology, self.policy
        if not (schedule is None or isinstance(schedule, str)):
            out["schedule"] = getattr(schedule, "config", lambda: repr(schedule))()
        if isinstance(topology, Topology):
            out["topology"] = topology.to_dict()
        if isinstance(policy, AdaptivePolicy):
            out["policy"] = policy.config()
        if out["schedule_options"] is not None:
            out["schedule_options"] = dict(out["schedule_options"])
        return out

    @classmethod
    def from_dict(cls, data):
        """The :class:`SyncConfig` of :meth:`to_dict`'s data. A schedule object cannot be rebuilt from its
        configuration: a dict for ``schedule`` raises a ``ValueError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Arg ``data`` has unknown keys {unknown}; SyncConfig takes {sorted(known)}.")
        if isinstance(data.get("schedule"), dict):
            raise ValueError("Arg ``schedule``: a schedule object cannot be rebuilt from its configuration "
                             f"({data['schedule']!r}); pass the object itself.")
        return cls(**data)

