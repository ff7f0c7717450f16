"""Horovod's rules for the PyTorch optimizer's arguments and calls, as ``hvd.DistributedOptimizer`` has them."""
import sys

from horovod.torch import functions as hvd_functions

__all__ = ["SYNCHRONIZE_WARNING", "check_named_parameters", "called_by_horovod_to_create_state"]

# Horovod's warning, word for word, so that scripts see what they know.
SYNCHRONIZE_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                       "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                       "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


def check_named_parameters(optimizer, named_parameters):
    """Horovod's rules: unique names, and every parameter of the optimizer named."""
    if named_parameters is None:
        return [(f"param.{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])]
    named_parameters = list(named_parameters)
    if any(not isinstance(p, tuple) or len(p) != 2 for p in named_parameters):
        raise ValueError("Arg ``named_parameters`` must be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters().")
    names = [name for name, _ in named_parameters]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Arg ``named_parameters`` has duplicate names: {', '.join(duplicates)}.")
    named = {id(p) for _, p in named_parameters}
    unnamed = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in named]
    if unnamed:
        raise ValueError(f"Arg ``named_parameters`` leaves {len(unnamed)} of the optimizer's parameters "
                         "unnamed; pass model.named_parameters() for the model the optimizer trains.")
    return named_parameters


def called_by_horovod_to_create_state():
    """Whether ``step()`` is called by ``hvd.broadcast_optimizer_state`` to create the optimizer's state."""
    # Our step() is reached through torch's profiling wrapper, so look a few frames up.
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code is hvd_functions.broadcast_optimizer_state.__code__:
            return True
        frame = frame.f_back
    return False
