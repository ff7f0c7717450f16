"""Sensing again when the network changes (:mod:`hvd_dssync.resense`), for the PyTorch adapter.

The default optimizer (``topology="auto"``, racks measured) notes what each average that crossed the network
cost; every ``CHECK_EVERY`` steps the ranks start gathering one figure each, and read them at the next check
(the gather completes in the background: a blocking one would hold every rank at each check until the
slowest, on racks the bridge ranks, arrived). Where the cost moved, they sense the racks again and the
optimizer follows the configuration that the sensing resolves to.
"""
import logging

import horovod.torch as hvd
import torch

from ..plan import GROUP
from ..resense import NetworkWatch
from . import collectives
from .functions import _sense_again, job_topology

__all__ = ["Resensing"]

log = logging.getLogger("hvd_dssync")


class Resensing:
    """The network's watch of one optimizer (:class:`hvd_dssync.resense.NetworkWatch`) and the sensing again.

    Args:
        name: the optimizer's op names.
        requested: the :class:`hvd_dssync.config.SyncConfig` as the user gave it (``topology="auto"``), which
            each sensing resolves anew.
        sensed: the :class:`hvd_dssync.sensing.Sensed` the optimizer was built on.

    Example::

        resensing = Resensing("dssync.0", requested, sensed)
        config = resensing.end_step(world, step, done)   # a collective at the check steps
        if config is not None:
            ...  # follow the new configuration from the next step on
    """

    def __init__(self, name, requested, sensed):
        self.name = name
        self.requested = requested
        self.sensed = sensed
        self.watch = NetworkWatch(requested.warmup_steps)
        self._gathering = None  # the last check's figures, on their way to every rank
        self.step = None  # the step of the last sensing again

    def end_step(self, world, step, done):
        """Note what this step's average cost (``done``: :class:`hvd_dssync.world.Done`, or None); at a check
        step, gather every rank's figure and, where the network changed, sense again. Returns the new resolved
        :class:`hvd_dssync.config.SyncConfig` where the racks differ from those in force, else None. The
        figures of one check are decided on at the next, from the same gathered figures on every rank."""
        if done is not None:
            action = done.action
            crosses = world.plan.schedule.crosses(action.group) if action.kind == GROUP else None
            self.watch.note(world.scope.world_size, done.seconds, crosses, len(action.group), action.kind)
        if not self.watch.due(step):
            return None
        gathering, self._gathering = self._gathering, None
        if gathering is None or not self.watch.decide(collectives.wait(gathering).numpy()[:, 0]):
            mine = torch.tensor([[self.watch.figure()]], dtype=torch.float64)
            self._gathering = hvd.allgather_async(mine, name=f"{self.name}.network", process_set=world.process_set)
            return None
        if hvd.rank() == 0:
            log.info(f"hvd_dssync: at step {step} an average across the network took {self.watch.last:.3f} s; "
                     "sensing the racks again")
        before, self.sensed = self.sensed, _sense_again()
        self.watch.restart()  # the window in progress ran on the old network: it is no reference
        self.step = step
        if self.sensed.racks == before.racks:
            return None
        config, _ = self.requested.resolve(lambda *_: (self.sensed.topology(), self.sensed), job_topology)
        return config
