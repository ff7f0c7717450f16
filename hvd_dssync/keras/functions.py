"""Whole-model helpers for Keras/TF2: exact global average, consensus distance, topology.

These run eagerly (from callbacks or between steps) and are collectives: call them on every rank.
"""
import math

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import sensing
from ..scope import add_process_set_groups as add_groups, scope_of
from ..topology import host_name, job_topology as resolve_topology

__all__ = ["synchronize_models", "consensus_distance", "job_topology", "add_process_set_groups"]


def _model_variables(model, non_trainable=True):
    if isinstance(model, tf.keras.Model):
        variables = list(model.trainable_variables)
        if non_trainable:
            variables += [v for v in model.non_trainable_variables if v.dtype.is_floating]
        return variables
    return [v for v in model if v.dtype.is_floating]


def synchronize_models(model, root_rank=None, non_trainable=True, process_set=hvd.global_process_set):
    """Replace every rank's model by the exact global average; all ranks end bit-identical.

    ``model`` is a Keras model or a list of variables. The average is one grouped allreduce over the ranks
    of ``process_set`` (call it on each of them); a broadcast from ``root_rank`` (a global rank; by default
    the set's first) then removes the last-bit differences an allreduce may leave.

    Example::

        dss.synchronize_models(model)
        if hvd.rank() == 0:
            model.save("model.keras")
    """
    scope = scope_of(hvd, process_set)
    root_rank = scope.root(root_rank)
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # under a LossScaleOptimizer
    if hasattr(optimizer, "synchronize"):  # a DS-Sync optimizer: its average in flight is folded in first
        optimizer.synchronize()
    variables = _model_variables(model, non_trainable)
    if scope.world_size == 1 or not variables:
        return
    averaged = hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in variables], op=hvd.Average,
                                     name="DSSync_synchronize_models", process_set=process_set)
    for v, a in zip(variables, averaged):
        v.assign(a)
    hvd.broadcast_variables(variables, root_rank=root_rank, process_set=process_set)


def consensus_distance(model, non_trainable=False, process_set=hvd.global_process_set):
    """RMS distance of the ranks' weights from their global mean: 0 when all models agree.

    ``sqrt(sum_ranks ||x_r - mean||^2 / (size * numel))`` over the ranks of ``process_set``, computed in
    float64; the same float on every rank of it (the per-rank terms are allgathered and summed in rank
    order everywhere).

    Example::

        print(f"consensus distance {dss.consensus_distance(model):.2e}")
    """
    size = scope_of(hvd, process_set).world_size
    variables = _model_variables(model, non_trainable)
    if size == 1 or not variables:
        return 0.0
    flat = tf.concat([tf.reshape(tf.cast(v, tf.float64), [-1]) for v in variables], axis=0)
    mean = hvd.allreduce(flat, op=hvd.Average, name="DSSync_consensus_mean", process_set=process_set)
    squared = tf.reshape(tf.reduce_sum(tf.square(flat - mean)), [1])
    per_rank = hvd.allgather(squared, name="DSSync_consensus_sum", process_set=process_set).numpy()
    return math.sqrt(math.fsum(per_rank.tolist()) / (size * int(flat.shape[0])))


def job_topology(spec=None):
    """The job's :class:`Topology`: each rank's host by an allgather of hostnames, racks from ``spec``.

    As ``hvd_dssync.torch.job_topology``; a collective.

    Example::

        topology = dss.job_topology()          # racks from HVD_DSSYNC_TOPOLOGY, else one per host
        print(topology.rack_ranks())
    """
    return resolve_topology(spec, hvd.size(),
                            lambda: hvd.allgather_object(host_name(), name="DSSync_hostnames"))



def allgather_job_rows(row, tag=0):
    """Every rank's int64 ``row`` over the whole job (one allgather named by ``tag``), as rows of a NumPy
    array: the agreement of :func:`hvd_dssync.scope.acquire_registered`.

    Example::

        rows = allgather_job_rows(np.array([1, 2]), tag=0)   # shape (hvd.size(), 2)
    """
    # Traced, so that the op keeps its own name: an eager Horovod op is named after its kind alone, and an
    # agreement some rank never joins would take that rank's next eager allgather for its own.
    gather = tf.function(lambda x: hvd.allgather(x, name=f"DSSync_scope_agree_{tag}"))
    return gather(tf.constant(np.asarray(row, dtype=np.int64).reshape(1, -1))).numpy()


def default_topology(schedule, num_groups, group_size, topology, schedule_options, whole_job):
    """``topology`` resolved as the PyTorch adapter does (:func:`hvd_dssync.sensing.default_topology`): "auto"
    becomes the sensed racks or ``None``; ``(topology, Sensed or None)``. Keras reads the topology eagerly when
    the optimizer is built, so the sensing runs there."""

    def allgather_rows(row):
        return hvd.allgather(tf.constant(np.asarray(row).reshape(1, -1)), name="DSSync_sense_figures").numpy()

    return sensing.default_topology(hvd, allgather_rows, "DSSync_sense_hosts", schedule, num_groups, group_size,
                                    topology, schedule_options, whole_job)


def add_process_set_groups(process_set, *, num_groups=None, group_size=None, seed=0, schedule=None,
                           schedule_options=None, sync=None):
    """Register the groups DS-Sync needs inside ``process_set`` as process sets (a collective).

    As ``hvd_dssync.torch.add_process_set_groups``: for ``DistributedOptimizer(..., process_set=ps)``, call it
    on *every* rank of the job, in the same order, with the optimizer's schedule arguments, before the
    optimizer is built on the set's ranks. ``sync``: the optimizer's :class:`hvd_dssync.SyncConfig`, instead
    of the keywords.

    Example::

        ps = hvd.add_process_set([0, 1, 2])                            # every rank
        dss.add_process_set_groups(ps, group_size=2, seed=0)           # every rank
        if ps.included():
            opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), process_set=ps, group_size=2, seed=0)
    """
    add_groups(hvd, process_set, sync=sync, num_groups=num_groups, group_size=group_size, seed=seed,
               schedule=schedule, schedule_options=schedule_options)
