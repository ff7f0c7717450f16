"""The outer step after each average (``outer_momentum``): SlowMo / DiLoCo's momentum on the averaged model."""
import torch

__all__ = ["OuterStep"]


class OuterStep:
    """Momentum on the change of the averaged model since the last average, with an outer learning rate of 1:
    ``m <- beta m + (x - anchor)``, then ``x <- anchor + m`` and ``anchor <- x``, where ``x`` is this rank's
    parameters just averaged and ``anchor`` their value after the previous outer step (the first average only
    sets it). ``beta = 0`` is plain averaging. No communication.

    Example::

        outer = OuterStep(momentum=0.5)
        outer.take(params)          # after each average: the parameters, moved in place
        saved = outer.state()       # for the checkpoint (None before the first average)
        outer.load(saved)
    """

    def __init__(self, momentum):
        self.momentum = momentum
        self._state = None  # (anchors, momentum buffers), from the first average on

    def take(self, params):
        """The outer step on ``params`` (the trained parameters, not the buffers: BatchNorm statistics stay as
        averaged), in place."""
        with torch.no_grad():
            if self._state is None:
                self._state = ([p.detach().clone() for p in params], [torch.zeros_like(p) for p in params])
                return
            for p, anchor, momentum in zip(params, *self._state):
                momentum.mul_(self.momentum).add_(p - anchor)
                p.copy_(anchor + momentum)
                anchor.copy_(p)

    def state(self):
        """The anchors and momentum, copied, for the checkpoint; None before the first average."""
        if self._state is None:
            return None
        return {"anchors": [a.clone() for a in self._state[0]], "momentum": [m.clone() for m in self._state[1]]}

    def load(self, outer):
        """Anchors and momentum saved by :meth:`state` (None: the next average sets them)."""
        self._state = None if outer is None else (list(outer["anchors"]), list(outer["momentum"]))
