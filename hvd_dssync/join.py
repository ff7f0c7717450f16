"""Uneven data under DS-Sync: ranks that run out of batches keep averaging until every rank has, then all
stop at the same step.

Horovod's recipe for uneven data is ``hvd.join()``: a rank with no more batches calls it, and the others'
allreduces go on without it until every rank has joined. Under DS-Sync the others still need the joined
rank in their groups, so a joined rank goes on taking the schedule's steps with its model as it is (no
local update), and all ranks must leave at one and the same step, without a global collective that the
ranks still training would not issue.

How the ranks agree, with no extra collective:

- Every average carries, after the step's signature, what its sender knows of who has joined and when
  (:meth:`JoinState.payload`: a 0/1 flag per rank and the flag times that rank's join step). An average of
  these is merged back (:meth:`JoinState.merge`): a flag above 0 means some member knew, and the step is
  the average of the products over the average of the flags.
- Knowledge then spreads exactly as the groups connect the ranks. From rank ``i``'s join step ``s_i``,
  the plan's groups (the same on every rank) say at which step every rank has heard of it
  (:func:`everyone_knows_at`). The ranks leave after step ``T = max_i`` of those steps: every rank can
  compute ``T`` once it knows every join step, and by ``T`` every rank does.

Framework-free: the adapter appends the payload to the collective it already runs.
"""
import numpy as np

__all__ = ["JoinState", "everyone_knows_at", "MAX_SPREAD_STEPS"]

# Steps after the last join within which the plan's groups must have connected every rank.
MAX_SPREAD_STEPS = 100_000


class JoinState:
    """What one rank knows of which ranks have joined (run out of data), and at which step.

    Example::

        >>> a, b = JoinState(3), JoinState(3)
        >>> a.note_joined(rank=0, step=7)
        >>> averaged = (a.payload() + b.payload()) / 2    # ranks 0 and 1 average in a group
        >>> b.merge(averaged)
        >>> b.joined_steps()
        {0: 7}
        >>> b.everyone_joined()
        False
    """

    def __init__(self, world_size):
        self.world_size = world_size
        self.reset()

    def reset(self):
        """Forget every join: the ranks left together and train on (the next epoch's uneven data)."""
        self._known = np.zeros(self.world_size, dtype=bool)
        self._steps = np.zeros(self.world_size, dtype=np.int64)
        self._leave = None  # computed once every join is known

    def note_joined(self, rank, step):
        """``rank`` (this one) has no more data; it serves steps from ``step`` on."""
        self._known[rank] = True
        self._steps[rank] = step

    def payload(self):
        """``2 * world_size`` numbers: a flag per rank known to have joined, then the flag times its join step."""
        flags = self._known.astype(np.float64)
        return np.concatenate([flags, flags * self._steps])

    def merge(self, averaged):
        """Take in the group's average of its members' payloads."""
        averaged = np.asarray(averaged, dtype=np.float64)
        flags, products = averaged[:self.world_size], averaged[self.world_size:]
        news = (flags > 0) & ~self._known
        self._steps[news] = np.rint(products[news] / flags[news])
        self._known |= news

    def everyone_joined(self):
        return bool(self._known.all())

    def joined_steps(self):
        """``{rank: step}`` of the joins this rank knows of."""
        return {int(r): int(self._steps[r]) for r in np.flatnonzero(self._known)}

    def last_to_join(self):
        """The rank that joined at the latest step (the highest such rank), as ``hvd.join()`` returns."""
        latest = self._steps[self._known].max()
        return int(np.flatnonzero(self._known & (self._steps == latest)).max())

    def leave_step(self, partition_at):
        """The step after which every rank leaves, once every join is known here; else ``None``.

        ``partition_at(step)`` gives every group that averages at ``step`` (empty for a local step).
        """
        if not self.everyone_joined():
            return None
        if self._leave is None:
            self._leave = everyone_knows_at(partition_at, dict(enumerate(self._steps.tolist())), self.world_size)
        return self._leave


def everyone_knows_at(partition_at, joined_steps, world_size, max_steps=MAX_SPREAD_STEPS):
    """The first step at whose end every rank has heard of every join.

    ``joined_steps`` is ``{rank: step}``: that rank's knowledge enters the averages from that step on.
    Raises ``RuntimeError`` when the groups do not connect every rank within ``max_steps`` steps of the
    last join (a schedule that never does cannot bring the models to consensus either).

    Example::

        >>> pairs = lambda step: ((0, 1), (2, 3)) if step % 2 == 0 else ((0, 2), (1, 3))
        >>> everyone_knows_at(pairs, {0: 4, 1: 4, 2: 5, 3: 4}, 4)
        6
    """
    heard = np.zeros((world_size, world_size), dtype=bool)  # heard[source, rank]
    start, last = min(joined_steps.values()), max(joined_steps.values())
    for step in range(start, last + max_steps + 1):
        for source, joined in joined_steps.items():
            if joined == step:
                heard[source, source] = True
        for group in partition_at(step):
            members = list(group)
            heard[:, members] = heard[:, members].any(axis=1, keepdims=True)
        if step >= last and heard.all():
            return step
    raise RuntimeError(f"hvd_dssync: the schedule's groups did not connect every rank within {max_steps} steps "
                       f"of the last join; ranks that ran out of data cannot leave together.")
