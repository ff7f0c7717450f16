"""``hvd.join()`` under DS-Sync: ranks with uneven data serve their groups' averages until all have left.

Who has joined rides along with every average (:mod:`hvd_dssync.join`), so every rank leaves after one and
the same step without an extra collective.
"""
import horovod.torch as hvd

from .live import live_optimizers

__all__ = ["join"]


def join(device=-1):
    """``hvd.join()`` for a job that trains with DS-Sync (uneven data): importing ``hvd_dssync.torch`` puts it
    in place of Horovod's, so the call in a script stays as it is.

    A rank with no more batches calls it. It then goes on taking part in its groups' averages with its model
    as it is, step by step, while the others train on; every rank returns after one and the same step,
    agreed without an extra collective (:mod:`hvd_dssync.join`). Returns the rank that joined last, as
    Horovod's does. Without a DS-Sync optimizer in training this is Horovod's own ``join``.

    The optimizers served are those stepped in the last training iteration, in the order they were stepped.
    Unlike Horovod's, a joined rank answers only DS-Sync's averages: a script's own collectives between
    steps (a metric's allreduce every batch) would wait for it, so average metrics after ``join()`` returns.

    Example::

        for batch in loader:            # some ranks have more batches than others
            ...
            opt.step()
        hvd.join()                      # every rank leaves at the same step
        dss.synchronize_models(model)
    """
    optimizers = _in_training()
    if not optimizers:
        return _horovod_join(device)
    for optimizer in optimizers:
        _check_joinable(optimizer)
        optimizer._joins.note_joined(optimizer._scope.rank, optimizer.sync_step)
    serving = list(optimizers)
    while serving:
        serving = [optimizer for optimizer in serving if not _serve(optimizer)]
    last = optimizers[0]._joins.last_to_join()
    for optimizer in optimizers:
        optimizer._joins.reset()
    return last


_horovod_join = hvd.join


def _check_joinable(optimizer):
    if optimizer._plan.adaptive is not None:
        raise RuntimeError("hvd_dssync: hvd.join() is not supported with policy='adaptive': its future steps "
                           "depend on figures not measured yet, so the ranks could not agree when to leave.")
    if optimizer._in_process_set():
        raise RuntimeError("hvd_dssync: hvd.join() joins the whole job, but this optimizer trains inside a "
                           "process set; make every rank take the same number of steps instead.")


def _serve(optimizer):
    """One step with this rank's model as it is (it has joined); ``True`` once every rank has left."""
    optimizer._take_step(serving=True)
    leave = optimizer._joins.leave_step(optimizer._plan.partition)
    return leave is not None and optimizer.sync_step > leave


def _in_training():
    """The DS-Sync optimizers stepped in the last training iteration (since the last-stepped one's step before
    that), in the order they were stepped."""
    stepped = sorted((o for o in live_optimizers if o._step_tick is not None), key=lambda o: o._step_tick)
    if not stepped:  # a rank without a single batch: every optimizer it built, in the order it built them
        return sorted(live_optimizers, key=lambda o: o._constructed)
    since = stepped[-1]._previous_tick
    return [o for o in stepped if since is None or o._step_tick > since]
