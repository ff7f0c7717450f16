"""``hvd.join()`` under DS-Sync: ranks with uneven data serve their groups' averages until all have left.

Who has joined rides along with every average (:mod:`hvd_dssync.join`), so every rank leaves after one and
the same step without an extra collective.
"""
import horovod.torch as hvd

from .live import in_training

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
    optimizers = in_training()
    if not optimizers:
        return _horovod_join(device)
    for optimizer in optimizers:
        optimizer.start_serving()
    serving = list(optimizers)
    while serving:
        serving = [optimizer for optimizer in serving if not optimizer.serve_joined()]
    return [optimizer.stop_serving() for optimizer in optimizers][0]


_horovod_join = hvd.join
