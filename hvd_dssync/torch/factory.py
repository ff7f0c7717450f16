"""``hvd_dssync.torch.DistributedOptimizer``: Horovod's signature, DS-Sync's arguments checked and resolved
(the racks sensed where asked), and the user's optimizer class with DS-Sync's step mixed in
(:class:`.optimizer.DSSyncOptimizer`, or :class:`.outside.OutsideProcessSet` on a rank outside the process set).
"""
import os
import warnings

import horovod.torch as hvd
import torch

from .. import build, horovod_loop
from ..config import config_of, warn_num_groups
from ..guards import check_nccl_process_sets
from ..plan import SyncPlan, check_horovod_arguments, routes_global_averages
from ..resense import watches
from ..scope import acquire_registered
from .arguments import HOROVOD_WRAPPER_MODULE, check_named_parameters
from .functions import _default_topology, allgather_job_rows, job_topology
from .optimizer import DSSyncOptimizer
from .outside import OutsideProcessSet

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=hvd.global_process_set, *,
                         group_size=None, seed=0, schedule=None, topology="auto",
                         warmup_steps=0, global_every=None, average_every=None, model=None, average_buffers=True,
                         overlap=None, schedule_options=None, outer_momentum=0.0, policy=None,
                         sparse_average=True, sync=None):
    """Wrap ``optimizer`` so that ranks average their models in shuffled groups (DS-Sync).

    Drop-in for ``hvd.DistributedOptimizer``: it takes the same arguments and returns an instance of
    ``optimizer``'s class. Each rank steps on its own gradient, then averages the model inside the group
    its schedule gives it for this step; the groups shuffle from step to step so that all models reach
    consensus. No gradient is allreduced outside the warm-up.

    Horovod's arguments keep their meaning where it applies: a lossy ``compression`` (``hvd.Compression.fp16``)
    compresses each rank's difference from a reference all ranks share, and each rank keeps its own
    compression error, so updates below the compression's resolution are not lost (the first averaging
    step is an exact average over the ranks that sets the reference; global averages move it; it costs one
    copy of the averaged tensors). ``process_set`` runs DS-Sync among that set's ranks only (build and step
    the optimizer on them alone, as with Horovod); its groups must be registered beforehand by every rank
    of the job, with :func:`init` (``process_sets=``) or :func:`add_process_set_groups`. ``op`` (Average or
    Sum), ``gradient_predivide_factor`` and ``sparse_as_dense`` apply to the warm-up's gradient allreduce;
    ``backward_passes_per_step`` gradients simply accumulate between steps; ``groups`` (Horovod's fusion
    grouping) is accepted and has nothing to act on, since the whole model is one grouped allreduce per
    step. ``op=hvd.Adasum`` is rejected. The arguments Horovod has come in Horovod's order with Horovod's
    defaults, so a script passing them by position means the same; Horovod's deprecated ``num_groups``
    (tensor fusion groups, default 0) is DS-Sync's number of groups, 0 choosing it as without it; a
    ``HorovodArgumentWarning`` says so where it is given (nothing is said for it in ``sync``).

    Without DS-Sync arguments the schedule is chosen from the job: "topology" when the racks are known
    (``topology=`` or ``HVD_DSSYNC_TOPOLOGY``), else random groups ("shuffle") of
    :func:`hvd_dssync.plan.default_group_size` (pairs for 4 ranks, groups of 4 from 8 ranks on).

    DS-Sync's own arguments follow (keyword-only, but ``num_groups``, at Horovod's position).

    Args:
        num_groups: groups per step (schedule "shuffle"); or give ``group_size``; or neither (0, the default).
        group_size: the largest group size ("shuffle"), or the butterfly's group size.
        seed: integer seed shared by all ranks.
        schedule: "shuffle", "butterfly", "topology", a schedule object with ``groups(step)``, or None
            (the default: "topology" where the racks are known, else "shuffle").
        topology: racks for schedule "topology" (a Topology, a JSON file, or lists of ranks); "auto" (the
            default) senses them when the optimizer is built where no other DS-Sync argument names the
            schedule (:mod:`hvd_dssync.sensing`): the hosts' layout, else timed host pairs; two racks or more
            make the default schedule "topology" on them, several hosts on one flat network one group of every
            rank (``num_groups=1``, averaging every 8 steps). With ``HVD_DSSYNC_RESENSE=1``, racks found by
            timing are sensed again when the averages across the network change cost, and the schedule
            follows (:mod:`hvd_dssync.resense`).
            ``opt.sensed`` says how, what and in how many seconds.
        warmup_steps: bulk-synchronous steps first (gradient allreduce over all ranks).
        global_every: average over all ranks every this many steps (0: never). Default (None): 32 where the
            optimizer picks the topology-aware schedule itself, and there the racks meet only in these
            averages (``intra_steps=None`` unless ``schedule_options`` names it), else 0
            (``hvd_dssync.config.default_rack_rhythm``).
        average_every: average every this many steps; the steps between are local, without communication
            (local SGD; with ``num_groups=1`` this is PyTorch's post-local SGD with period
            ``average_every``). ``global_every`` counts steps too, and the schedule advances once per
            group average. Default (None): 8 where the optimizer picks the topology-aware schedule itself
            (racks sensed or given, no ``schedule``), 8 where it sensed hosts on one flat network (one group
            of every rank), else 1 (``hvd_dssync.config.default_average_every``).
        model: the module; its floating-point buffers (BatchNorm statistics) are averaged too, and evaluating
            it (``model.eval()`` under ``torch.no_grad()``) folds in an average in flight first (``overlap``).
        average_buffers: set False to keep buffers local.
        overlap: True starts each average asynchronously: it runs behind the local steps that follow and is
            folded in (``model += average - sent``, keeping the progress made meanwhile) once done, at the
            latest where the next average starts; ``synchronize_models``, ``state_dict``, the exit drain and
            evaluating ``model`` fold it in first. A global average on racks then goes over every rank at
            once, folded in the step after it started (``hvd_dssync.overlap.folds_now``), one op, or in as
            many fragments as ``HVD_DSSYNC_GLOBAL_FRAGMENTS`` says (each a part of the model sent at a step of
            its own, folded in at the next); beside ``global_via_bridges=True`` it keeps the route, waited for
            (its three averages would each wait for the one before).
            None (the default): in a job of several hosts, decided by a
            trial after the warm-up, on where it makes the steps shorter (``hvd_dssync.overlap``; off on one
            host, with a lossy compression, sparse averaging or the adaptive policy); a probe before it
            decides whether the global averages go through the racks, waited for, or over every rank, in
            flight, in as many fragments as hide behind a step each (``hvd_dssync.fragments.global_fragments``).
            On racks whose period DS-Sync chose, a probe of the racks every half period in flight comes first:
            where their averages hide, it keeps that period and overlap on (``hvd_dssync.rhythm``).
            False: every average is waited for.
        schedule_options: extra arguments for the named schedule (e.g. ``window_steps``).
        outer_momentum: momentum of an outer step after each average (SlowMo / DiLoCo style, outer learning
            rate 1): the parameters move by ``m <- outer_momentum * m + change of the averaged model since
            the last average``; 0 (the default) is plain averaging. Costs two copies of the parameters.
        policy: None or "fixed" (the periods above), or "adaptive" (or an
            :class:`hvd_dssync.adaptive.AdaptivePolicy`): the ranks measure what their averages cost and
            choose together, every ``decide_every`` steps, between global and group averages and the period
            (from ``average_every`` up); ``global_every`` must be 0. Each decision is in
            ``last_sync["decision"]`` at the step that took it, and in the checkpoint.
        sparse_average: average embedding tables whose gradients are sparse (``nn.Embedding(...,
            sparse=True)``, ``nn.EmbeddingBag``) over only the rows that can differ between the members
            (:mod:`hvd_dssync.sparse`): the same result as a dense average, at a cost proportional to the
            rows in play. ``last_sync["sparse_rows"]`` counts the rows averaged so, ``last_sync["row_set"]``
            this rank's rows in play. Needs an optimizer that changes only the rows it reports (SGD,
            SparseAdam, Adagrad); off with ``overlap=True`` or a lossy ``compression`` (and then no trial of
            overlap). False: dense.
        sync: a :class:`hvd_dssync.SyncConfig` holding every DS-Sync argument above, instead of them (the
            same object builds the Keras optimizer and registers the groups: :func:`init`,
            :func:`add_process_set_groups`); with it, the keywords above keep their defaults.

    Example::

        import horovod.torch as hvd
        import hvd_dssync.torch as dss

        hvd.init()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
        opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model,
                                       group_size=4, seed=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    scope = check_horovod_arguments(hvd, op, gradient_predivide_factor, backward_passes_per_step, process_set)
    build.warn_once(hvd.rank())  # rank 0 says once what another Horovod build lacks
    horovod_loop.set_idle_cycle()  # Horovod's loop sleeps between DS-Sync's ops (docs/build.md)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Arg ``optimizer`` must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    warn_num_groups(num_groups)  # Horovod's fusion groups, DS-Sync's groups here: docs/faq.md
    in_process_set = scope.world_size != hvd.size()
    # DS-Sync's own arguments, checked before any communication (hvd_dssync.config.config_of).
    config = config_of(sync, dict(num_groups=num_groups or None, group_size=group_size, seed=seed, schedule=schedule,
                                  topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                                  average_every=average_every, schedule_options=schedule_options, policy=policy,
                                  outer_momentum=outer_momentum, overlap=overlap,
                                  average_buffers=bool(average_buffers), sparse_average=bool(sparse_average)),
                       in_process_set)
    if config.overlap and compression is not hvd.Compression.none:
        raise ValueError("Arg ``compression`` is not supported with overlap=True.")
    named_parameters = check_named_parameters(optimizer, named_parameters)
    # topology="auto": the racks sensed (hvd_dssync.sensing), or None where there is one rack; where they were
    # measured, sensed again when the network changes if HVD_DSSYNC_RESENSE=1 (hvd_dssync.resense).
    requested = config
    config, sensed = config.resolve(_default_topology, job_topology, in_process_set)
    # A rank outside the set validates as its ranks do (at the set's first position), then trains alone.
    plan = SyncPlan.from_config(0 if scope.outside else scope.rank, scope.world_size, config)
    routes_global_averages(plan.schedule, "PyTorch", lossy_compression=compression is not hvd.Compression.none,
                           adaptive=plan.adaptive is not None, overlapped=config.overlap is True)
    if in_process_set and plan.schedule.window_steps is not None:
        raise ValueError(f"Arg ``process_set``: the schedule {plan.schedule!r} changes its groups every "
                         f"{plan.schedule.window_steps} steps, but inside a process set the groups are registered "
                         "once, by every rank of the job; use one endless window (window_steps=None).")
    check_nccl_process_sets(plan.schedule.window_steps, hvd.nccl_built(),
                            on_gpu=any(p.is_cuda for _, p in named_parameters),
                            gpu_operations=os.environ.get("HOROVOD_GPU_ALLREDUCE") or
                            os.environ.get("HOROVOD_GPU_OPERATIONS"))
    if hvd.size() == 1 and config.overlap:
        warnings.warn("overlap=True does nothing with one rank.")
    if scope.outside:
        acquire_registered(hvd, scope, plan.schedule.window_groups(0), "hvd_dssync.torch.DistributedOptimizer",
                           take=False, allgather_rows=allgather_job_rows)
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(OutsideProcessSet.__dict__, __module__=HOROVOD_WRAPPER_MODULE))
        return cls(optimizer.param_groups, process_set, backward_passes_per_step)
    # Named Horovod's wrapper module, so that hvd.broadcast_optimizer_state creates the state without a
    # DS-Sync step (hvd_dssync.torch.arguments.HOROVOD_WRAPPER_MODULE), as for Horovod's own optimizer.
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(DSSyncOptimizer.__dict__, __module__=HOROVOD_WRAPPER_MODULE))
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, sparse_as_dense,
                  process_set if in_process_set else hvd.global_process_set, config, plan, model, scope, sensed,
                  (requested, sensed) if watches(sensed, config.adaptive()) else None,
                  requested.quickens_racks(config))
    return wrapped
