"""What every rank's Keras optimizer does alone, as Horovod's does: its own gradients, the local variables
(``register_local_var``), ``backward_passes_per_step`` and Horovod's pass helper (``_agg_helper``).

:class:`LocalSteps` is mixed in below the DS-Sync optimizer on the ranks of the optimizer's process set and
below :class:`.outside.OutsideProcessSet` on the others (``hvd_dssync.keras.optimizer``).
"""
import weakref

import tensorflow as tf

__all__ = ["LocalSteps", "PassAggregation", "gradient_names"]


class LocalSteps:
    """What every rank's optimizer does alone: its own gradients, local variables, ``backward_passes_per_step``
    (the module says where it is mixed in)."""

    @classmethod
    def wrapping(cls, optimizer, local, **setup):
        """A new optimizer of this class from ``optimizer``'s configuration (as Horovod builds its own), set up
        in one step by its constructor: ``local`` are :meth:`_dssync_local_setup`'s arguments, ``setup`` the
        mixin's ``_dssync_setup``'s (:func:`DistributedOptimizer` calls it)."""
        return cls.from_config(dict(optimizer.get_config(), dssync_local=local, dssync_setup=setup))

    def __init__(self, *args, dssync_local, dssync_setup, **kwargs):
        # Keras' from_config passes the configuration to the constructor; DS-Sync's parts ride along, and
        # the user's optimizer class gets the rest.
        super(self.__class__, self).__init__(*args, **kwargs)
        self._dssync_local_setup(*dssync_local)
        self._dssync_setup(**dssync_setup)

    def _dssync_local_setup(self, process_set, set_size, passes, average_aggregated, scale_local_gradients):
        self._dssync_passes = passes
        self._dssync_average_aggregated = average_aggregated
        # Horovod divides a local variable's gradient by the size of the optimizer's process set; None: the
        # size of DS-Sync's world, read when the step is traced.
        self._dssync_set_size = set_size
        # Gradient sums between applied steps; left out of Keras' tracking, so never saved (as Horovod's).
        object.__setattr__(self, "_dssync_sums", {})
        self._dssync_local_vars = set()
        # Horovod's attributes that scripts read, with their DS-Sync meaning (docs/keras.md).
        object.__setattr__(self, "_local_vars", self._dssync_local_vars)
        object.__setattr__(self, "_agg_helper", None if passes == 1 else
                           PassAggregation(self, passes, average_aggregated, self._dssync_local_vars))
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients

    @property
    def sync_step(self):
        """The DS-Sync step: the number of applied steps, ``iterations // backward_passes_per_step``.

        As with Horovod, ``iterations`` counts every pass, also those that only accumulate gradients.
        """
        return int(self.iterations.numpy()) // self._dssync_passes

    def register_local_var(self, var):
        """Keep ``var`` local to this rank, as Horovod: its gradient is never allreduced and it is never averaged.

        With ``scale_local_gradients`` (the default, as in Horovod) its gradient is divided by the size of the
        optimizer's process set when applied.
        """
        self._dssync_local_vars.add(var.ref())

    def _dssync_scale_local(self, grads, variables):
        """``grads`` with those of local variables divided by the process set's size (``scale_local_gradients``).

        Horovod does it where it allreduces the others, after summing the passes; a division commutes with
        the sum, so here it is done to the gradients applied.
        """
        size = self._dssync_set_size or self._dssync.plan.world_size
        if not self.scale_local_gradients or not self._dssync_local_vars or size == 1:
            return list(grads)
        out = list(grads)
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None or v.ref() not in self._dssync_local_vars:
                continue
            if isinstance(g, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
            else:
                out[i] = g / size
        return out

    def _dssync_accumulate(self, grads, variables, averaged, args, kwargs):
        """``backward_passes_per_step`` > 1, as Horovod: sum this pass's gradients; step on every last pass.

        The other passes only count themselves in ``iterations``. The step applies the sum (the mean with
        ``average_aggregated_gradients``) with :meth:`_dssync_step`, at step ``iterations //
        backward_passes_per_step``.
        """
        passes = self._dssync_passes
        with tf.init_scope():
            # The wrapped optimizer's variables must exist before its update is traced inside tf.cond.
            if hasattr(self, "_create_all_weights"):
                self._create_all_weights(variables)
            else:
                self.build(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        sums = [self._dssync_sum(variables[i]) for i in present]
        added = [s.assign_add(tf.convert_to_tensor(grads[i])) for s, i in zip(sums, present)]
        last = tf.equal(tf.math.floormod(self.iterations + 1, passes), 0)

        def step():
            total = list(grads)
            for s, i in zip(sums, present):
                total[i] = s / passes if self._dssync_average_aggregated else tf.identity(s)
            done = self._dssync_step(total, variables, averaged, self.iterations // passes, args, kwargs)
            with tf.control_dependencies([d for d in done if d is not None]):
                cleared = [s.assign(tf.zeros_like(s)) for s in sums]
            with tf.control_dependencies(cleared):
                return tf.identity(self.iterations)

        def count():
            return tf.identity(self.iterations.assign_add(1))

        with tf.control_dependencies(added):
            return tf.cond(last, step, count)

    def _dssync_sum(self, variable):
        key = variable.ref()
        if key not in self._dssync_sums:
            with tf.init_scope():
                self._dssync_sums[key] = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                                     name="dssync_gradient_sum")
        return self._dssync_sums[key]


def gradient_names(base):
    """The gradient method of Horovod's two names that the Keras optimizer class ``base`` lacks, calling the one
    it has: legacy optimizers have ``_compute_gradients``, the others ``compute_gradients``, and Horovod's
    optimizers answer both. Either gives this rank's own gradients: unlike Horovod's, not allreduced (DS-Sync
    averages models instead).

    Example::

        >>> sorted(gradient_names(tf.keras.optimizers.SGD)), sorted(gradient_names(tf.keras.optimizers.legacy.SGD))
        (['_compute_gradients'], ['compute_gradients'])
    """
    if not hasattr(base, "compute_gradients"):
        def compute_gradients(self, loss, var_list, tape=None):
            """This rank's own gradients, as :meth:`_compute_gradients`."""
            return self._compute_gradients(loss, var_list, None, tape)

        return {"compute_gradients": compute_gradients}
    if not hasattr(base, "_compute_gradients"):
        def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
            """This rank's own gradients, as :meth:`compute_gradients`."""
            return self.compute_gradients(loss, var_list, tape=tape)

        return {"_compute_gradients": _compute_gradients}
    return {}


class PassAggregation:
    """The optimizer's ``_agg_helper`` (Horovod's name) with ``backward_passes_per_step`` > 1: Horovod's helper's
    readable attributes.

    The accumulation itself runs in the optimizer (``_dssync_accumulate``).
    """

    def __init__(self, optimizer, passes, average_aggregated_gradients, local_vars):
        self._optimizer = weakref.ref(optimizer)
        self.backward_passes_per_step = passes
        self.average_aggregated_gradients = average_aggregated_gradients
        self._local_vars = local_vars  # the optimizer's set (Horovod's helper keeps them with passes > 1)

    @property
    def counter(self):
        """Passes since the last applied step, as Horovod's counter."""
        return tf.math.floormod(self._optimizer().iterations, self.backward_passes_per_step)

    def register_local_var(self, var):
        self._optimizer().register_local_var(var)
