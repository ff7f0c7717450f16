"""hvd_dssync: DS-Sync (divide-and-shuffle synchronization) as a drop-in Horovod optimizer.

The core (schedules, topology, policy, plan, simulator) needs only numpy; the adapters live in
``hvd_dssync.torch`` and ``hvd_dssync.keras``.
"""
from .config import HorovodArgumentWarning, SyncConfig
from .policy import Policy
from .schedules import Butterfly, Schedule, Shuffle, TopologyAware, make_schedule
from .topology import Topology

__version__ = "0.1.0"
__all__ = ["SyncConfig", "HorovodArgumentWarning", "Schedule", "Shuffle", "Butterfly", "TopologyAware", "Topology", "Policy", "make_schedule"]
