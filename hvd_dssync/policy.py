"""What one training step does: bulk-synchronous warm-up, group averaging, or a global average.

One :class:`Policy` decides for both adapters, from the step number alone, so every rank takes the same
decision without communicating.
"""
__all__ = ["Policy", "BSP", "GROUP", "GLOBAL"]

BSP = "bsp"        # allreduce the gradients over all ranks, then step (Horovod's DistributedOptimizer)
GROUP = "group"    # step on the local gradient, then average the model inside the step's group
GLOBAL = "global"  # step on the local gradient, then average the model over all ranks


def _non_negative_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Arg ``{name}`` must be a non-negative integer, got {value!r}.")
    return value


class Policy:
    """Hybrid schedule of synchronization modes.

    Args:
        warmup_steps: the first ``warmup_steps`` steps are bulk-synchronous (post-local SGD's warm-up,
            Sync-Switch's offline policy).
        global_every: after warm-up, every ``global_every``-th step averages over all ranks instead of the
            group (WAGMA-SGD); 0 never does.

    Example::

        >>> p = Policy(warmup_steps=2, global_every=3)
        >>> [p.action(t) for t in range(6)]
        ['bsp', 'bsp', 'group', 'group', 'global', 'group']
    """

    def __init__(self, warmup_steps=0, global_every=0):
        self.warmup_steps = _non_negative_int("warmup_steps", warmup_steps)
        self.global_every = _non_negative_int("global_every", global_every)

    def action(self, step):
        if step < self.warmup_steps:
            return BSP
        if self.global_every and (step - self.warmup_steps + 1) % self.global_every == 0:
            return GLOBAL
        return GROUP

    def config(self):
        return {"warmup_steps": self.warmup_steps, "global_every": self.global_every}

    def __repr__(self):
        return f"Policy(warmup_steps={self.warmup_steps}, global_every={self.global_every})"
