"""Whole-model helpers for PyTorch: exact global average, consensus distance, job topology, init."""
import math
import os
import time

import horovod.torch as hvd
import numpy as np
import torch

from .. import sensing
from ..config import SyncConfig, config_of
from ..process_sets import enable_dynamic_process_sets, registry_for, use_static_process_sets
from ..scope import add_process_set_groups as add_groups, process_set_groups, scope_of
from ..topology import Topology, host_name, job_topology as resolve_topology, round_robin_pairings
from . import collectives
from .live import finish_pending_averages

__all__ = ["synchronize_models", "consensus_distance", "job_topology", "probe_topology", "init",
           "add_process_set_groups"]


def _model_tensors(model, buffers=True):
    tensors = [p.data for p in model.parameters()]
    if buffers:
        tensors += [b for b in model.buffers() if b.is_floating_point()]
    return tensors


def synchronize_models(model, root_rank=None, buffers=True, process_set=hvd.global_process_set):
    """Replace every rank's model by the exact global average; all ranks end bit-identical.

    Call it on every rank (of ``process_set``), e.g. at the end of training or before saving. The average
    is one grouped allreduce over the ranks of ``process_set``; a broadcast from ``root_rank`` (a global
    rank; by default the set's first rank) then removes the last-bit differences an allreduce may leave.

    Example::

        dss.synchronize_models(model)
        if hvd.rank() == 0:
            torch.save(model.state_dict(), "model.pt")
    """
    scope = scope_of(hvd, process_set)
    root_rank = scope.root(root_rank)
    finish_pending_averages()
    tensors = _model_tensors(model, buffers)
    if scope.world_size == 1 or not tensors:
        return
    with torch.no_grad():
        collectives.grouped_allreduce_(tensors, name="dssync.synchronize_models", op=hvd.Average,
                                       process_set=process_set)
        handles = [hvd.broadcast_async_(t, root_rank, name=f"dssync.synchronize_models.{i}", process_set=process_set)
                   for i, t in enumerate(tensors)]
        for handle in handles:
            collectives.wait(handle)


def consensus_distance(model, buffers=False, process_set=hvd.global_process_set):
    """RMS distance of the ranks' parameters from their global mean: 0 when all models agree.

    ``sqrt(sum_ranks ||x_r - mean||^2 / (size * numel))`` over the ranks of ``process_set``; a collective
    returning the same float on every rank of it (the per-rank terms are allgathered and summed in rank
    order everywhere).

    Example::

        print(f"consensus distance {dss.consensus_distance(model):.2e}")
    """
    size = scope_of(hvd, process_set).world_size
    finish_pending_averages()
    tensors = _model_tensors(model, buffers)
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    if size == 1:
        return 0.0
    mean = hvd.allreduce(flat, name="dssync.consensus.mean", op=hvd.Average, process_set=process_set)
    squared = ((flat - mean) ** 2).sum().reshape(1)
    per_rank = hvd.allgather(squared, name="dssync.consensus.sum", process_set=process_set)
    total = math.fsum(per_rank.tolist())
    return math.sqrt(total / (size * flat.numel()))


def job_topology(spec=None):
    """The job's :class:`Topology`: each rank's host by an allgather of hostnames, racks from ``spec``.

    ``spec`` is a Topology, a JSON file or string, or racks as lists of ranks or hostnames; without it,
    ``HVD_DSSYNC_TOPOLOGY`` is read, else every host is its own rack. A collective.

    Example::

        topology = dss.job_topology([[0, 1], [2, 3]])   # two racks of two ranks
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), schedule="topology",
                                       topology=topology)
    """
    return resolve_topology(spec, hvd.size(),
                            lambda: hvd.allgather_object(host_name(), name="dssync.hostnames"))


def probe_topology(nbytes=1048576, repeats=2, min_margin=sensing.MIN_MARGIN):
    """Find the racks by timing an allreduce between every pair of hosts; a :class:`Topology`.

    The lowest rank of each host represents it. In rounds of disjoint host pairs (every pair meets once),
    each pair's representatives time ``repeats`` allreduces of ``nbytes`` on a two-rank process set
    after one unmeasured warm-up, and the fastest counts (a one-off stall of a shared core is no slow
    link); every other rank issues as many one-element ops on its own one-rank set, so all ranks keep the
    same op sequence. The racks are those of the rack rule (:func:`hvd_dssync.sensing.decide_racks`): the
    partition whose links inside are all faster than its links across by ``min_margin`` or more, else one
    rack. A collective; with one host there is nothing to time.

    Example::

        topology = dss.probe_topology()
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       schedule="topology", topology=topology)
    """
    rank_hosts = hvd.allgather_object(host_name(), name="dssync.probe.hosts")
    hosts = list(dict.fromkeys(rank_hosts))
    if len(hosts) == 1:
        return Topology(rank_hosts)
    leaders = [rank_hosts.index(h) for h in hosts]
    registry = registry_for(hvd)
    seconds = torch.zeros(len(hosts), len(hosts), dtype=torch.float64)
    payload, tiny = torch.zeros(max(1, nbytes // 4)), torch.zeros(1)
    for pairs in round_robin_pairings(len(hosts)):
        busy = {leaders[a]: (a, b) for a, b in pairs} | {leaders[b]: (a, b) for a, b in pairs}
        partition = [(leaders[a], leaders[b]) for a, b in pairs] + \
                    [(r,) for r in range(hvd.size()) if r not in busy]
        registry.acquire(partition)
        me = hvd.rank()
        group = next(g for g in partition if me in g)
        process_set = registry.get(group)
        tensor = payload if me in busy else tiny
        hvd.allreduce_(tensor, name="dssync.probe.warm", process_set=process_set)
        fastest = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            hvd.allreduce_(tensor, name="dssync.probe", process_set=process_set)
            fastest = min(fastest, time.perf_counter() - started)
        if me in busy:
            a, b = busy[me]
            seconds[a, b] = seconds[b, a] = fastest
        registry.release(partition)
    seconds = hvd.allreduce(seconds, op=hvd.Max, name="dssync.probe.seconds")
    racks = sensing.decide_racks(seconds.numpy(), min_margin).racks
    host_racks = {hosts[h]: index for index, rack in enumerate(racks) for h in rack}
    return Topology(rank_hosts, host_racks)


def allgather_job_rows(row, tag=0):
    """Every rank's int64 ``row`` over the whole job (one allgather named by ``tag``), as rows of a NumPy
    array: the agreement of :func:`hvd_dssync.scope.acquire_registered`.

    Example::

        rows = allgather_job_rows(np.array([1, 2]), tag=0)   # shape (hvd.size(), 2)
    """
    return hvd.allgather(torch.from_numpy(np.asarray(row, dtype=np.int64)).reshape(1, -1),
                         name=f"dssync.scope.agree.{tag}").numpy()


def _default_topology(schedule, num_groups, group_size, topology, schedule_options, whole_job):
    """``DistributedOptimizer``'s ``topology`` resolved by :func:`hvd_dssync.sensing.default_topology`:
    "auto" becomes the sensed racks or ``None``; ``(topology, Sensed or None)``."""
    return sensing.default_topology(hvd, _allgather_figures, "dssync.sense.hosts", schedule, num_groups, group_size,
                                    topology, schedule_options, whole_job)


def _sense_again(previous):
    """The job's racks sensed anew, after ``previous`` (:func:`hvd_dssync.sensing.sense_again`); a collective."""
    return sensing.sense_again(hvd, _allgather_figures, "dssync.sense.hosts", previous)


def _allgather_figures(row):
    return hvd.allgather(torch.from_numpy(row).reshape(1, -1), name="dssync.sense.figures").numpy()


STATIC_SETS_PER_RANK = 8  # the most static sets one rank joins in :func:`init`, or it uses dynamic sets


def init(comm=None, *, num_groups=None, group_size=None, seed=0, schedule=None, topology=None,
         world_size=None, schedule_options=None, process_sets=None, sync=None):
    """``hvd.init()`` with the schedule's process sets registered statically where possible.

    Static process sets (``hvd.init(process_sets=...)``) cost less on every Horovod cycle than dynamic
    ones: Horovod's dynamic mode adds a global exchange to every cycle (docs/tuning.md has what it cost).
    They fit schedules whose groups never change (``butterfly``,
    ``shuffle`` with its default endless window) and those whose windows repeat (``topology`` given as
    ranks, whose bridges rotate: every group of the rotation is registered, while no rank is in more than
    ``STATIC_SETS_PER_RANK`` of them, since each set negotiates on every cycle); Horovod then runs without
    dynamic process sets (unless ``HOROVOD_DYNAMIC_PROCESS_SETS`` was set by the user), so no other process
    set can be added later. Other schedules with finite windows get dynamic process sets, as does
    ``topology="auto"`` (the optimizer may then sense the racks). Pass the same schedule arguments to
    :func:`DistributedOptimizer` afterwards: they are checked as it checks them
    (:class:`hvd_dssync.config.SyncConfig`), with its errors, before Horovod starts.

    With ``process_sets`` (Horovod ``ProcessSet`` objects, as for ``hvd.init``), DS-Sync will train inside
    each of them (``DistributedOptimizer(..., process_set=ps)``): those sets and each one's groups are
    registered, statically, instead of the whole job's groups. Call it on every rank.

    The world size is read from the launcher's environment (horovodrun, mpirun) or ``comm``. ``sync``: the
    :class:`hvd_dssync.SyncConfig` the optimizer will take, instead of the keywords (with its default
    ``topology="auto"`` and no schedule named, the groups are left to the optimizer's sensing: dynamic sets).

    Example::

        dss.init(schedule="butterfly")
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), schedule="butterfly")

        sync = hvd_dssync.SyncConfig(schedule="butterfly", seed=1)   # or one object for both
        dss.init(sync=sync)
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync=sync)
    """
    arguments = dict(num_groups=num_groups, group_size=group_size, seed=seed, schedule=schedule,
                     schedule_options=schedule_options)
    if sync is not None:
        config = config_of(sync, arguments if topology is None else dict(arguments, topology=topology))
        arguments, topology = config.schedule_arguments(), config.topology
    if process_sets is not None:
        _init_with_process_sets(comm, list(process_sets), arguments)
        return
    size = world_size or _launcher_world_size(comm)
    static = _static_groups(SyncConfig(topology=topology, **arguments).startup_schedule(size), size)
    if static is None:
        enable_dynamic_process_sets()
        hvd.init(comm=comm)
    else:
        use_static_process_sets()
        hvd.init(comm=comm, process_sets=[hvd.ProcessSet(list(g)) for g in static])
    registry_for(hvd).reset()


def _static_groups(schedule, size):
    """The groups of ``schedule`` (None: not known before Horovod starts) to register as static process sets,
    or None for dynamic ones: its windows never repeat, or a rank would be in more than
    ``STATIC_SETS_PER_RANK`` of them. The group of every rank is the global set itself."""
    groups = None if schedule is None else schedule.every_group()
    if groups is None:
        return None
    groups = [g for g in groups if len(g) < size]
    if max((sum(r in g for g in groups) for r in range(size)), default=0) > STATIC_SETS_PER_RANK:
        return None
    return groups


def _init_with_process_sets(comm, process_sets, schedule_arguments):
    """``hvd.init`` with the user's sets and, statically, the groups DS-Sync needs inside each."""
    if any(not isinstance(ps, hvd.ProcessSet) or ps.ranks is None for ps in process_sets):
        raise ValueError("Arg ``process_sets`` must be a list of hvd.ProcessSet objects made from lists of ranks.")
    arguments = SyncConfig(**schedule_arguments).schedule_arguments()
    taken = {tuple(ps.ranks) for ps in process_sets}
    groups = []
    for ps in process_sets:
        groups += [g for g in process_set_groups(ps.ranks, **arguments) if g not in taken]
        taken.update(groups)
    hvd.init(comm=comm, process_sets=process_sets + [hvd.ProcessSet(list(g)) for g in groups])
    registry_for(hvd).reset()


def add_process_set_groups(process_set, *, num_groups=None, group_size=None, seed=0, schedule=None,
                           schedule_options=None, sync=None):
    """Register the groups DS-Sync needs inside ``process_set`` as dynamic process sets (a collective).

    For :func:`DistributedOptimizer` with ``process_set=``: ``hvd.add_process_set`` involves every rank of
    the job, so call this on *every* rank, in the same order, with the optimizer's schedule arguments;
    the optimizer itself (on the set's ranks only) then finds its groups registered. :func:`init` with
    ``process_sets=`` does the same statically, at ``hvd.init``. ``sync``: the optimizer's
    :class:`hvd_dssync.SyncConfig`, instead of the keywords.

    Example::

        hvd.init()
        ps = hvd.add_process_set([0, 1, 2])                            # every rank
        dss.add_process_set_groups(ps, group_size=2, seed=0)           # every rank
        if ps.included():
            opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           process_set=ps, group_size=2, seed=0)
    """
    add_groups(hvd, process_set, sync=sync, num_groups=num_groups, group_size=group_size, seed=seed,
               schedule=schedule, schedule_options=schedule_options)


def _launcher_world_size(comm):
    if comm is not None:
        return comm.Get_size() if hasattr(comm, "Get_size") else len(comm)
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return None
