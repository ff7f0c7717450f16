"""DS-Sync for PyTorch: swap ``hvd.DistributedOptimizer`` for ``hvd_dssync.torch.DistributedOptimizer``.

Importing this module before ``hvd.init()`` lets a plain ``hvd.init()`` add process sets later
(it sets ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` unless the user set it).

Example::

    import horovod.torch as hvd
    import hvd_dssync.torch as dss

    hvd.init()
    opt = dss.DistributedOptimizer(opt, named_parameters=model.named_parameters(), num_groups=2, seed=0)
    ...
    dss.synchronize_models(model)
"""
import horovod.torch

from ..process_sets import enable_dynamic_process_sets

enable_dynamic_process_sets()

from .functions import (add_process_set_groups, consensus_distance, init, job_topology, probe_topology,  # noqa: E402
                        synchronize_models)
from .factory import DistributedOptimizer  # noqa: E402
from .uneven import join  # noqa: E402

# Horovod's recipe for uneven data, hvd.join(), keeps working unchanged: ranks that run out of data must go on
# averaging with their groups under DS-Sync, so hvd.join is DS-Sync's from here on (Horovod's own without a
# DS-Sync optimizer in training).
horovod.torch.join = join

__all__ = ["DistributedOptimizer", "synchronize_models", "consensus_distance", "job_topology", "probe_topology",
           "init", "add_process_set_groups", "join"]
