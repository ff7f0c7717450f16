"""Sensing again when the network changes (:mod:`hvd_dssync.resense`), for the PyTorch adapter.

The default optimizer (``topology="auto"``, racks measured) notes what each average that crossed the network
cost; every ``CHECK_EVERY`` steps the ranks start gathering one figure each, and read them at the next check
(the gather completes in the background: a blocking one would hold every rank at each check until the
slowest, on racks the bridge ranks, arrived). Where the cost moved, they sense the racks again, timing only
the pairs across the racks in force (:func:`hvd_dssync.sensing.known_figures`). Where the racks changed, the
new groups' process sets are registered ahead, by a thread, while training goes on in the old groups
(:meth:`hvd_dssync.process_sets.ProcessSetRegistry.register_ahead`); the ranks gather at every step whether
their thread is done, and all follow the new configuration at the first step where every rank's was.
"""
import logging

import horovod.torch as hvd
import torch

from ..plan import GROUP, SyncPlan
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
        registry: the :class:`hvd_dssync.process_sets.ProcessSetRegistry` the new groups are registered in.

    Example::

        resensing = Resensing("dssync.0", requested, sensed, registry)
        config = resensing.end_step(world, step, done)   # a collective at the check steps
        if config is not None:
            ...  # follow the new configuration from the next step on: its sets are registered
    """

    def __init__(self, name, requested, sensed, registry):
        self.name = name
        self.requested = requested
        self.sensed = sensed
        self.registry = registry
        self.watch = NetworkWatch(requested.warmup_steps)
        self._gathering = None  # the last check's figures, on their way to every rank
        self._following = None  # the configuration whose sets are being registered ahead
        self.step = None  # the step of the last sensing again
        self.followed = None  # the first step on the racks it found, where they differ from those before

    def end_step(self, world, step, done):
        """Note what this step's average cost (``done``: :class:`hvd_dssync.world.Done`, or None); at a check
        step, gather every rank's figure and, where the network changed, sense again. Returns the new resolved
        :class:`hvd_dssync.config.SyncConfig` at the step where every rank has its sets, else None. The
        figures of one check are decided on at the next, from the same gathered figures on every rank."""
        if done is not None:
            action = done.action
            crosses = world.plan.schedule.crosses(action.group) if action.kind == GROUP else None
            self.watch.note(world.scope.world_size, done.seconds, crosses, len(action.group), action.kind,
                            overlapped=done.overlapped)
        if not (self.watch.due(step) or self._following is not None):
            return None
        gathering, self._gathering = self._gathering, None
        gathered = None if gathering is None else collectives.wait(gathering).numpy()
        if self._following is not None:
            self.watch.figure()  # the old groups' averages: no reference for the new ones
            if gathered is None or not gathered[:, 1].all():
                self._gather(world)
                return None
            config, self._following = self._following, None
            self.watch.restart()
            self.followed = step + 1
            return config
        if gathered is None or not self.watch.decide(gathered[:, 0]):
            self._gather(world)
            return None
        return self._sense_again(world, step)

    def record(self):
        """What the optimizer reports as ``opt.sensed``: the last sensing's, with the ``step`` it sensed again at
        and the step it ``followed`` new racks from (None: the same racks, or their sets not registered yet)."""
        return dict(self.sensed.to_dict(), step=self.step, followed=self.followed)

    def _gather(self, world):
        """Start gathering this rank's figure and whether its sets registered ahead are done."""
        mine = torch.tensor([[self.watch.figure(), float(self.registry.ahead_done())]], dtype=torch.float64)
        self._gathering = hvd.allgather_async(mine, name=f"{self.name}.network", process_set=world.process_set)

    def _sense_again(self, world, step):
        if hvd.rank() == 0:
            log.info(f"hvd_dssync: at step {step} an average across the network took {self.watch.last:.3f} s; "
                     "sensing the racks again")
        before, self.sensed = self.sensed, _sense_again(self.sensed)
        self.watch.restart()  # the window in progress ran on the old network: it is no reference
        self.step, self.followed = step, None
        if self.sensed.racks == before.racks:
            return None
        config, _ = self.requested.resolve(lambda *_: (self.sensed.topology(), self.sensed), job_topology)
        # The groups the new configuration averages in first, registered while the old ones go on.
        change = SyncPlan.from_config(world.scope.rank, world.scope.world_size, config).window_change(step + 1)
        self.registry.register_ahead(change[0])
        self._following = config
        self._gather(world)
        return None
