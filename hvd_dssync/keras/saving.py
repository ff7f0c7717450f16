"""Loading a saved Keras model with its optimizer wrapped by DS-Sync, as ``hvd.load_model`` does.

Above the optimizer: it builds :func:`hvd_dssync.keras.DistributedOptimizer`, so the optimizer's modules
never import it.
"""
import os

import tensorflow as tf

from .optimizer import DistributedOptimizer

__all__ = ["load_model"]


def load_model(filepath, custom_optimizers=None, custom_objects=None, compile=True, **options):
    """Load a saved Keras model with its optimizer wrapped by DS-Sync, as ``hvd.load_model`` does.

    ``options`` are :func:`DistributedOptimizer`'s arguments (``num_groups=``, ``seed=`` ...). The
    optimizer's ``iterations`` come back from the file, and with them the DS-Sync step: the schedule
    continues where it stopped. Works with h5, SavedModel and ``.keras`` files.

    Example::

        model = dss.load_model("model.h5", num_groups=2, seed=0)
    """
    # Keras 2 has a legacy and a new optimizer of each name; the saved config says which it was.
    new = {cls.__name__: cls for cls in tf.keras.optimizers.Optimizer.__subclasses__()}
    legacy = {cls.__name__: cls for cls in tf.keras.optimizers.legacy.Optimizer.__subclasses__()}
    new.update({cls.__name__: cls for cls in custom_optimizers or []})

    def wrap(name):
        def from_config(klass, config, custom_objects=None):
            # Keras's own rule: a config without the flag is a legacy optimizer's.
            chosen = legacy if config.get("is_legacy_optimizer", True) and name in legacy else new
            base = chosen.get(name) or legacy[name]
            return DistributedOptimizer(base.from_config(config), **options)

        base = new.get(name) or legacy[name]
        return type(name, (base,), {"from_config": classmethod(from_config)})

    objects = {}
    for name in set(new) | set(legacy):
        objects[name] = objects[name.lower()] = wrap(name)
    objects.update(custom_objects or {})
    model = tf.keras.models.load_model(filepath, custom_objects=objects, compile=compile)
    variables = os.path.join(str(filepath), "variables", "variables")
    if compile and model.optimizer is not None and os.path.exists(variables + ".index"):
        # Keras 2 loads a SavedModel's weights but not its optimizer's state (iterations, slots); the
        # checkpoint inside holds them under the model's "optimizer" (slots restore once built).
        tf.train.Checkpoint(optimizer=model.optimizer).restore(variables).expect_partial()
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer) if compile else None
    if hasattr(optimizer, "set_model"):
        # The optimizer was built before its model: give it the model's BatchNorm statistics to average.
        optimizer.set_model(model)
    return model
