"""DS-Sync for Keras and TF2: swap ``hvd.DistributedOptimizer`` for ``hvd_dssync.keras.DistributedOptimizer``.

Importing this module before ``hvd.init()`` lets a plain ``hvd.init()`` add process sets later
(it sets ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` unless the user set it).

Example::

    import horovod.tensorflow.keras as hvd
    import hvd_dssync.keras as dss

    hvd.init()
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), num_groups=2, seed=0)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               dss.callbacks.SynchronizeModelsCallback()])
"""
from ..process_sets import enable_dynamic_process_sets

enable_dynamic_process_sets()

from . import callbacks, elastic  # noqa: E402
from .functions import add_process_set_groups, consensus_distance, job_topology, synchronize_models  # noqa: E402
from .model_averager import ModelAverager  # noqa: E402
from .optimizer import DistributedOptimizer  # noqa: E402
from .saving import load_model  # noqa: E402

__all__ = ["DistributedOptimizer", "ModelAverager", "callbacks", "elastic", "synchronize_models",
           "consensus_distance", "load_model", "job_topology", "add_process_set_groups"]
