"""The optimizer a rank outside the optimizer's process set gets: it trains alone, as with Horovod.

``hvd.DistributedOptimizer(opt, process_set=ps)`` on a rank that ``ps`` does not hold registers no hooks:
``step()`` is the wrapped optimizer's own, and nothing is sent. Scripts build the optimizer on every rank
(Horovod's own tests do), so DS-Sync does the same: the arguments are validated exactly as on the set's
ranks (the same error everywhere), then this rank gets Horovod's interface over a plain local step.
"""
import contextlib

__all__ = ["OutsideProcessSet"]


class OutsideProcessSet:
    """Mixed into the user's optimizer class on a rank outside ``process_set``: Horovod's interface, no
    communication.

    Example::

        opt = dss.DistributedOptimizer(opt, named_parameters=..., process_set=even_set)   # on an odd rank
        opt.step()                                                   # this rank's own update, nothing sent
    """

    def __init__(self, params, process_set, backward_passes_per_step):
        super(self.__class__, self).__init__(params)
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self.sync_step = 0
        self.last_sync = None

    def step(self, closure=None):
        loss = super(self.__class__, self).step(closure)
        self.sync_step += 1
        return loss

    def synchronize(self):
        """Nothing to wait for: this rank is outside the optimizer's process set."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
