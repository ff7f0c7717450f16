"""Whole-model helpers for PyTorch: exact global average, consensus distance, job topology, init."""
import math
import socket

import horovod.torch as hvd
import torch

from ..plan import SyncPlan
from ..process_sets import enable_dynamic_process_sets, registry_for
from ..topology import Topology, job_topology as resolve_topology

__all__ = ["synchronize_models", "consensus_distance", "job_topology", "init"]


def _model_tensors(model, buffers=True):
    tensors = [p.data for p in model.parameters()]
    if buffers:
        tensors += [b for b in model.buffers() if b.is_floating_point()]
    return tensors


def _finish_pending_averages():
    from .optimizer import _live_optimizers

    for optimizer in list(_live_optimizers):
        optimizer.finish_pending()


def synchronize_models(model, root_rank=0, buffers=True):
    """Replace every rank's model by the exact global average; all ranks end bit-identical.

    Call it on every rank, e.g. at the end of training or before saving. The average is one grouped
    allreduce over all ranks; a broadcast from ``root_rank`` then removes the last-bit differences an
    allreduce may leave between ranks.

    Example::

        dss.synchronize_models(model)
        if hvd.rank() == 0:
            torch.save(model.state_dict(), "model.pt")
    """
    _finish_pending_averages()
    tensors = _model_tensors(model, buffers)
    if hvd.size() == 1 or not tensors:
        return
    with torch.no_grad():
        hvd.grouped_allreduce_(tensors, name="dssync.synchronize_models", op=hvd.Average)
        handles = [hvd.broadcast_async_(t, root_rank, name=f"dssync.synchronize_models.{i}")
                   for i, t in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)


def consensus_distance(model, buffers=False):
    """RMS distance of the ranks' parameters from their global mean: 0 when all models agree.

    ``sqrt(sum_ranks ||x_r - mean||^2 / (size * numel))``; a collective returning the same float on every
    rank (the per-rank terms are allgathered and summed in rank order everywhere).

    Example::

        print(f"consensus distance {dss.consensus_distance(model):.2e}")
    """
    _finish_pending_averages()
    tensors = _model_tensors(model, buffers)
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    if hvd.size() == 1:
        return 0.0
    mean = hvd.allreduce(flat, name="dssync.consensus.mean", op=hvd.Average)
    squared = ((flat - mean) ** 2).sum().reshape(1)
    per_rank = hvd.allgather(squared, name="dssync.consensus.sum")
    total = math.fsum(per_rank.tolist())
    return math.sqrt(total / (hvd.size() * flat.numel()))


def job_topology(spec=None):
    """The job's :class:`Topology`: each rank's host by an allgather of hostnames, racks from ``spec``.

    ``spec`` is a Topology, a JSON file or string, or racks as lists of ranks or hostnames; without it,
    ``HVD_DSSYNC_TOPOLOGY`` is read, else every host is its own rack. A collective.

    Example::

        topology = dss.job_topology([[0, 1], [2, 3]])   # two racks of two ranks
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), schedule="topology", topology=topology)
    """
    return resolve_topology(spec, hvd.size(),
                            lambda: hvd.allgather_object(socket.gethostname(), name="dssync.hostnames"))


def init(comm=None, *, num_groups=None, group_size=None, seed=0, schedule="shuffle", topology=None,
         world_size=None, schedule_options=None):
    """``hvd.init()`` with the schedule's process sets registered statically where possible.

    Static process sets (``hvd.init(process_sets=...)``) cost less on every Horovod cycle than dynamic
    ones. They fit schedules whose groups never change (``butterfly``, ``topology`` given as ranks, and
    ``shuffle`` with its default endless window); a schedule with finite windows gets dynamic process
    sets. Pass the same schedule arguments to :func:`DistributedOptimizer` afterwards.

    The world size is read from the launcher's environment (horovodrun, mpirun) or ``comm``.

    Example::

        dss.init(schedule="butterfly")
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), schedule="butterfly")
    """
    size = world_size or _launcher_world_size(comm)
    static = None
    if size and (schedule != "topology" or isinstance(topology, (list, Topology))):
        spec = Topology.parse(topology) if topology is not None else None
        plan = SyncPlan(0, size, schedule=schedule, num_groups=num_groups, group_size=group_size, seed=seed,
                        topology=spec, schedule_options=schedule_options)
        if plan.schedule.window_steps is None:
            static = [g for g in plan.schedule.window_groups(0) if len(g) < size]
    if static is None:
        enable_dynamic_process_sets()
        hvd.init(comm=comm)
    else:
        hvd.init(comm=comm, process_sets=[hvd.ProcessSet(list(g)) for g in static])
    registry_for(hvd).reset()


def _launcher_world_size(comm):
    import os

    if comm is not None:
        return comm.Get_size() if hasattr(comm, "Get_size") else len(comm)
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return None
