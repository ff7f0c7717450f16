"""Mixed precision for the PyTorch adapter: ``torch.cuda.amp.GradScaler`` around DS-Sync's step.

The optimizer declares ``_step_supports_amp_scaling``, so GradScaler always calls ``step()``, with
``grad_scale`` and ``found_inf`` set on the optimizer: a rank whose gradient overflowed still takes part in
its group's average, and skips only its local update.
"""
import contextlib

import torch

__all__ = ["amp_scaling", "unscale_gradients", "gradients_overflow"]


@contextlib.contextmanager
def amp_scaling(optimizer):
    """GradScaler's ``grad_scale`` and ``found_inf`` for this step, hidden from the wrapped step meanwhile.

    GradScaler sets them before calling step() and deletes them after; plain torch optimizers assert that
    they are None, so the local update applies them instead.

    Example::

        with amp_scaling(optimizer) as (grad_scale, found_inf):
            ...
    """
    hidden = {key: getattr(optimizer, key) for key in ("grad_scale", "found_inf") if hasattr(optimizer, key)}
    for key in hidden:
        delattr(optimizer, key)
    try:
        yield hidden.get("grad_scale"), hidden.get("found_inf")
    finally:
        for key, value in hidden.items():
            setattr(optimizer, key, value)


def unscale_gradients(param_groups, grad_scale):
    """Divide the gradients by ``grad_scale``, for ``scaler.step()`` without ``scaler.unscale_()`` first.

    Example::

        unscale_gradients(optimizer.param_groups, grad_scale)
    """
    inv_scale = grad_scale.double().reciprocal().float()
    with torch.no_grad():
        for group in param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inv_scale.to(p.grad.device))


def gradients_overflow(param_groups):
    """Whether any gradient holds inf or NaN.

    Example::

        found_inf = gradients_overflow(optimizer.param_groups)
    """
    grads = [p.grad for group in param_groups for p in group["params"] if p.grad is not None]
    return any(not torch.isfinite(g.coalesce().values() if g.is_sparse else g).all() for g in grads)
