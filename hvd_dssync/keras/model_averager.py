"""DS-Sync for TF2 custom loops: a :class:`StepSync` with its own step counter, for ``tf.GradientTape`` users."""
import horovod.tensorflow as hvd
import tensorflow as tf

from ..config import SyncConfig
from ..process_sets import elastic_job
from .functions import default_topology, job_topology
from .sync import StepSync, make_plan

__all__ = ["ModelAverager"]


class ModelAverager(tf.Module):
    """DS-Sync for TF2 custom loops: average variables inside the step's group, in or out of ``tf.function``.

    For users of ``hvd.DistributedGradientTape``: keep a plain ``tf.GradientTape`` (each rank steps on
    its own gradient), apply the gradients, then call the averager on the model's variables. It keeps
    its own step counter (saved with ``tf.train.Checkpoint``), so the groups change from call to call
    inside one traced function. In warm-up steps (``warmup_steps``) call :meth:`gradients` before
    applying them, as with Horovod's tape; outside the warm-up it returns them unchanged.

    Its arguments (keyword-only) are :func:`hvd_dssync.keras.DistributedOptimizer`'s DS-Sync arguments, plus
    ``compression`` for the averaged tensors and ``name`` for the Horovod ops (unique per averager).

    Example::

        averager = dss.ModelAverager(num_groups=2, seed=0)

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = averager.gradients(tape.gradient(loss, model.trainable_variables))
            opt.apply_gradients(zip(grads, model.trainable_variables))
            averager(model.variables)
            return loss
    """

    def __init__(self, *, num_groups=None, group_size=None, seed=0, schedule=None, topology=None,
                 warmup_steps=0, global_every=None, average_every=None, schedule_options=None,
                 compression=hvd.Compression.none,
                 name="DSSyncAverager"):
        super().__init__(name=name)
        config = SyncConfig(num_groups=num_groups, group_size=group_size, seed=seed, schedule=schedule,
                            topology=topology, warmup_steps=warmup_steps, global_every=global_every,
                            average_every=average_every, schedule_options=schedule_options)
        config, _ = config.resolve(default_topology, job_topology, routes=False)
        self._sync = StepSync(make_plan(config), compression=compression, name=name, config=config)
        self._options = {"compression": type(compression).__name__}
        if not elastic_job():  # under elastic Horovod, at the first trace instead (see the module's docstring)
            self._sync.connect("hvd_dssync.keras.ModelAverager", options=self._options)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    @property
    def schedule(self):
        return self._sync.plan.schedule

    @property
    def policy(self):
        return self._sync.plan.policy

    def gradients(self, grads):
        """The gradients averaged over all ranks in a warm-up step, else unchanged."""
        self._sync.ensure_connected("hvd_dssync.keras.ModelAverager", options=self._options)
        with tf.control_dependencies([self._sync.adopt_root_step(self.step)]):
            return self._sync.gradients(list(grads), self.step.read_value())

    def __call__(self, variables):
        """Average the floating-point ``variables`` inside this step's group, then count the step."""
        variables = [v for v in variables if v.dtype.is_floating]
        self._sync.ensure_connected("hvd_dssync.keras.ModelAverager", options=self._options)
        with tf.control_dependencies([self._sync.adopt_root_step(self.step)]):
            step = self.step.read_value()
        with tf.control_dependencies([self._sync.average(variables, step)]):
            return self.step.assign_add(1)
