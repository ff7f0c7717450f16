"""The Keras optimizer a rank outside the optimizer's process set gets: it trains alone, as with Horovod.

On a rank that ``process_set`` does not hold, Horovod's Keras ``DistributedOptimizer`` sends nothing: its
gradient allreduce is conditioned on ``process_set.included()`` and passes the gradients through. The rank
applies its own gradients, still summed over ``backward_passes_per_step`` passes (their mean with
``average_aggregated_gradients``), and still divides a local variable's gradient by the set's size
(``scale_local_gradients``). Scripts build the optimizer on every rank (Horovod's own tests do), so DS-Sync
does the same: :func:`hvd_dssync.keras.DistributedOptimizer` validates the arguments exactly as on the set's
ranks (the same error everywhere), then gives this rank that plain local step with Horovod's interface.
"""
import tensorflow as tf

__all__ = ["OutsideProcessSet"]


class OutsideProcessSet:
    """Mixed into the user's optimizer class, above the shared local steps, on a rank outside ``process_set``.

    Example::

        opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), process_set=even_set)  # on an odd rank
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y)                                        # this rank's own updates, nothing sent
    """

    def _dssync_setup(self, sparse_as_dense):
        self._dssync_sparse_as_dense = sparse_as_dense

    def set_model(self, model):
        """Nothing to average here; the same check as on the set's ranks."""
        if not isinstance(model, tf.keras.Model):
            raise TypeError(f"Arg ``model`` must be a tf.keras.Model, got {type(model).__name__}.")

    def _allreduce_grads(self, grads, vars=None):
        """``grads`` unchanged, as Horovod's on a rank outside its process set (dense with ``sparse_as_dense``)."""
        if not self._dssync_sparse_as_dense:
            return list(grads)
        return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return super(self.__class__, self).apply_gradients(grads_and_vars, *args, **kwargs)
        grads, variables = (list(x) for x in zip(*grads_and_vars))
        if self._dssync_passes == 1:
            grads = self._dssync_scale_local(grads, variables)
            return super(self.__class__, self).apply_gradients(zip(grads, variables), *args, **kwargs)
        return self._dssync_accumulate(grads, variables, [], args, kwargs)

    def _dssync_step(self, grads, variables, averaged, step, args, kwargs):
        """The applied step of :meth:`_dssync_accumulate`: this rank's update alone."""
        grads = self._dssync_scale_local(grads, variables)
        iteration = super(self.__class__, self).apply_gradients(zip(grads, variables), *args, **kwargs)
        return iteration, None
