"""Horovod's rules for the PyTorch optimizer's arguments and calls, as ``hvd.DistributedOptimizer`` has them."""
from horovod.torch import optimizer as hvd_optimizer

__all__ = ["SYNCHRONIZE_WARNING", "check_named_parameters", "HOROVOD_WRAPPER_MODULE"]

# ``hvd.broadcast_optimizer_state`` fills an empty optimizer state with a zero-gradient step on every rank;
# for an optimizer whose class is in this module (a distributed wrapper: Horovod's own) it steps the wrapped
# optimizer's class directly, ``super(type(opt), opt).step()``, rather than the wrapper's step, which would
# communicate. The wrapper classes DS-Sync builds name this module, so that no such step averages or
# advances the schedule.
HOROVOD_WRAPPER_MODULE = hvd_optimizer.DistributedOptimizer.__module__

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

