"""What one training step does: bulk-synchronous warm-up, a local step, group averaging, or a global average.

One :class:`Policy` decides for both adapters, from the step number alone, so every rank takes the same
decision without communicating.
"""
import math

__all__ = ["Policy", "BSP", "GROUP", "GLOBAL", "LOCAL"]

BSP = "bsp"        # allreduce the gradients over all ranks, then step (Horovod's DistributedOptimizer)
GROUP = "group"    # step on the local gradient, then average the model inside the step's group
GLOBAL = "global"  # step on the local gradient, then average the model over all ranks
LOCAL = "local"    # step on the local gradient only: no communication (local SGD)


def _positive_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        rule = "a non-negative" if minimum == 0 else "a positive"
        raise ValueError(f"Arg ``{name}`` must be {rule} integer, got {value!r}.")
    return value


class Policy:
    """Hybrid schedule of synchronization modes.

    Steps are counted from 0. The first ``warmup_steps`` are bulk-synchronous; after them, step ``t`` is
    the ``s = t - warmup_steps + 1``-th step of the averaging phase, and:

    - if ``global_every`` divides ``s``: a global average (WAGMA-SGD's periodic global sync);
    - else if ``average_every`` divides ``s``: a group average, the schedule's next one;
    - else: a local step, without communication (local SGD).

    Both periods count *steps*, as PyTorch's ``PeriodicModelAverager`` and ``HierarchicalModelAverager``
    do: ``average_every=2, global_every=8`` averages in groups on steps 2, 4, 6 and over all ranks on step
    8. With ``num_groups=1`` and ``average_every=H``, DS-Sync is post-local SGD with period ``H``.

    The schedule advances once per group average, not once per step (:meth:`schedule_step`), so every
    partition of the schedule is used whatever the period: a two-partition schedule averaged every
    second step still alternates its partitions.

    Args:
        warmup_steps: the first ``warmup_steps`` steps are bulk-synchronous (post-local SGD's warm-up,
            Sync-Switch's offline policy).
        global_every: average over all ranks every ``global_every`` steps after the warm-up; 0 never.
        average_every: average (in the group) every ``average_every`` steps after the warm-up; the steps
            between are local. 1 (the default) averages on every step.

    Example::

        >>> p = Policy(warmup_steps=2, global_every=3)
        >>> [p.action(t) for t in range(6)]
        ['bsp', 'bsp', 'group', 'group', 'global', 'group']
        >>> p = Policy(average_every=2, global_every=4)
        >>> [p.action(t) for t in range(8)]
        ['local', 'group', 'local', 'global', 'local', 'group', 'local', 'global']
    """

    def __init__(self, warmup_steps=0, global_every=0, average_every=1):
        self.warmup_steps = _positive_int("warmup_steps", warmup_steps, 0)
        self.global_every = _positive_int("global_every", global_every, 0)
        self.average_every = _positive_int("average_every", average_every, 1)
        self.since = None  # with_period: (the step from which average_every holds, the policy before it)
        # with_period: no group average within this many steps of a global average's start (0: none skipped).
        self.global_span = 0

    def with_period(self, step, average_every):
        """This policy up to the first start of an averaging period of both this rhythm and the new one (a whole
        number of the longer ``average_every`` after the warm-up) from ``step`` on, then the group averages every
        ``average_every`` steps, a divisor or a multiple of this policy's: the global averages stay where they were
        and the schedule's groups go on in their order. ``step`` is the first step not taken yet; a shorter period
        starts after it where the step before was a global average (it sized its fragments by the steps to the next
        average, :meth:`steps_to_next_average`). Where the new period is shorter than the one built, the group
        averages wait the period built after each global average (:attr:`global_span`; where the global averages
        come every whole number of it, more than one): a global average in flight goes in a fragment a step until
        the next average, and a ring across the racks of an eighth of the model hides behind a step where one of a
        quarter does not (docs/tuning.md). Returns the new policy (its :attr:`since` holds where it starts); its
        :meth:`config` is the one built.

        Example::

            >>> p = Policy(warmup_steps=1, average_every=4, global_every=8).with_period(3, 2)
            >>> p.since[0], [p.action(t) for t in range(1, 17)]   # doctest: +NORMALIZE_WHITESPACE
            (5, ['local', 'local', 'local', 'group', 'local', 'group', 'local', 'global', 'local', 'local', 'local',
                 'group', 'local', 'group', 'local', 'global'])
            >>> [p.schedule_step(t) for t in (4, 6, 12)], p.steps_to_next_average(8), p.steps_to_next_average(6)
            ([1, 2, 3], 4, 2)
            >>> back = p.with_period(9, 4)   # and back: every 4 from step 9
            >>> back.since[0], [back.action(t) for t in range(9, 17)], back.schedule_step(12)
            (9, ['local', 'local', 'local', 'group', 'local', 'local', 'local', 'global'], 3)
            >>> back.config() == Policy(warmup_steps=1, average_every=4, global_every=8).config()
            True
        """
        every = _positive_int("average_every", average_every, 1)
        if self.average_every % every and every % self.average_every:
            raise ValueError(f"Arg ``average_every``: {every} must divide the policy's {self.average_every}, or be "
                             "a multiple of it")
        longer = max(every, self.average_every)
        # The step before, taken already, sized its global average's fragments by the old rhythm: a shorter one after.
        late = every < self.average_every and step > self.warmup_steps and self.action(step - 1) == GLOBAL
        first = max(step + 1 if late else step, self.warmup_steps)
        start = self.warmup_steps + -(-(first - self.warmup_steps) // longer) * longer
        policy = Policy(self.warmup_steps, self.global_every, every)
        policy.since = (start, self)
        built = self.config()["average_every"]
        if every < built and self.global_every > built and self.global_every % built == 0:
            policy.global_span = built
        return policy

    def action(self, step):
        if self.since is not None and step < self.since[0]:
            return self.since[1].action(step)
        if step < self.warmup_steps:
            return BSP
        s = step - self.warmup_steps + 1
        if self.global_every and s % self.global_every == 0:
            return GLOBAL
        if s % self.average_every == 0 and not 0 < s % (self.global_every or 1) < self.global_span:
            return GROUP
        return LOCAL

    def schedule_step(self, step):
        """The step of the schedule whose groups step ``step`` uses: it advances once per group average.

        Global averages and local steps do not use the schedule, so they do not advance it: every
        partition of the schedule takes its turn whatever the periods. Equal to ``step`` when
        ``average_every`` is 1 and ``global_every`` is 0.

        Example::

            >>> p = Policy(average_every=3)
            >>> [p.schedule_step(t) for t in (2, 5, 8)]
            [0, 1, 2]
            >>> p = Policy(global_every=2)  # steps 0, 2, 4 average in groups, steps 1, 3, 5 globally
            >>> [p.schedule_step(t) for t in (0, 2, 4)]
            [0, 1, 2]
        """
        if step < self.warmup_steps:
            return step
        if self.since is None:
            return self.warmup_steps + self._group_averages(step)
        start, before = self.since
        if step < start:
            return before.schedule_step(step)
        return before.schedule_step(start) + self._group_averages(step) - self._group_averages(start)

    def _group_averages(self, step):
        """The group averages of the steps from the warm-up's end to ``step`` (not included), by this rhythm."""
        done = step - self.warmup_steps
        group_averages = done // self.average_every
        if self.global_every:
            group_averages -= done // self.period()
        if self.global_span:  # those within a global average's span, (span - 1) // every of each global_every
            cycles, spanned = divmod(done, self.global_every)
            each = (self.global_span - 1) // self.average_every
            group_averages -= cycles * each + min(each, spanned // self.average_every)
        return group_averages

    def steps_to_next_average(self, step):
        """How many steps after ``step`` the next one that averages comes (a group or a global average): what a
        global average in fragments may take, a fragment a step (:func:`hvd_dssync.fragments.fragment_count`).

        Example::

            >>> p = Policy(average_every=4, global_every=8)
            >>> p.steps_to_next_average(3), p.steps_to_next_average(7), p.steps_to_next_average(5)
            (4, 4, 2)
        """
        for ahead in range(1, self.period() + 1):
            if self.action(step + ahead) != LOCAL:
                return ahead
        return self.period()

    def period(self):
        """Steps after which the pattern of kinds repeats (after the warm-up).

        Example::

            >>> Policy(average_every=2, global_every=3).period()
            6
        """
        return math.lcm(self.average_every, self.global_every or 1)

    def config(self):
        if self.since is not None:
            return self.since[1].config()
        return {"warmup_steps": self.warmup_steps, "global_every": self.global_every,
                "average_every": self.average_every}

    def __repr__(self):
        return (f"Policy(warmup_steps={self.warmup_steps}, global_every={self.global_every}, "
                f"average_every={self.average_every})")
