"""Elastic Horovod for Keras: ``hvd_dssync.keras.elastic.KerasState`` replaces ``hvd.elastic.KerasState``.

When ``hvd.elastic.run`` re-initializes Horovod for a new world (a worker removed or added), the DS-Sync
optimizer must follow: its schedule is rebuilt for the new world size from the same arguments, its
process sets are registered again, and the traced ``train_function`` is dropped, because Horovod fixes
the process sets of an op when a ``tf.function`` is traced. This state's reset hook does the first and
the last (no communication); the next ``fit`` or ``train_on_batch`` retraces the step, and the trace checks
that the ranks agree and registers the new process sets, every rank at the same point.

The DS-Sync step is the optimizer's ``iterations``, which the state syncs from rank 0 with the other
optimizer variables, so the schedule continues from rank 0's step.
"""
import horovod.tensorflow.keras.elastic as hvd_elastic

__all__ = ["KerasState"]


class KerasState(hvd_elastic.KerasState):
    """``hvd.elastic.KerasState`` that also moves DS-Sync to the new world after an elastic reset.

    Same arguments as Horovod's: the model (built), the optimizer (default: the model's) and the extra
    properties to sync (``epoch=0, batch=0`` ...). After each reset (``hvd.elastic.run`` has
    re-initialized Horovod), before the user's reset callbacks: the DS-Sync optimizer rebuilds its
    schedule for the new world size (``num_groups``/``group_size`` capped at it; a schedule object or
    ``schedule="topology"`` raises a ``RuntimeError``), and ``model.train_function`` is dropped so that the
    next ``fit``/``train_on_batch`` retraces the step with the new process sets. A plain optimizer is left
    alone. With Horovod's own ``KerasState`` the old traced step would run on: it stops with an error
    that names this class.

    Under elastic Horovod the optimizer builds without communicating; build its variables before the state
    (``opt.build(model.trainable_variables)``), so that a joining worker's optimizer variables match the
    others' when the state syncs them.

    Example::

        import horovod.tensorflow.keras as hvd
        import hvd_dssync.keras as dss

        hvd.init()
        opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9), group_size=2, seed=0)
        model.compile(optimizer=opt, loss="mse")
        opt.build(model.trainable_variables)
        state = dss.elastic.KerasState(model, batch=0, epoch=0)

        @hvd.elastic.run
        def train(state):
            model.fit(x, y, steps_per_epoch=100, epochs=10 - state.epoch, verbose=0,
                      callbacks=[hvd.elastic.UpdateBatchStateCallback(state),
                                 hvd.elastic.UpdateEpochStateCallback(state),
                                 hvd.elastic.CommitStateCallback(state)])

        train(state)
    """

    def reset(self):
        super().reset()
        for optimizer in _dssync_optimizers(self.optimizer, getattr(self.model, "optimizer", None)):
            optimizer.follow_world()
        # Keras 2 retraces the step at the next fit/train_on_batch (make_train_function).
        self.model.train_function = None


def _dssync_optimizers(*candidates):
    """The distinct DS-Sync optimizers among ``candidates``, looking inside loss-scale wrappers."""
    found = []
    for optimizer in candidates:
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        if hasattr(optimizer, "follow_world") and all(optimizer is not f for f in found):
            found.append(optimizer)
    return found
