"""Any object with ``groups(step)``, checked and cached (:class:`UserSchedule`)."""
from .base import SCHEDULE_NAMES, Schedule, _check_int, canonical_partition, validate_partition

__all__ = ["UserSchedule"]


class UserSchedule(Schedule):
    """Wraps any object with ``groups(step)`` (and optionally ``window_steps``) and validates it.

    Each window's partitions are read once from the user's object, checked to cover every rank exactly
    once, and checked to be the same when asked twice. Without ``window_steps`` the object's groups must
    repeat with a period of at most 32 steps (the first 64 are read).

    Example::

        >>> class Pairs:
        ...     world_size = 4
        ...     def groups(self, step):
        ...         return [[0, 1], [2, 3]] if step % 2 == 0 else [[0, 3], [1, 2]]
        >>> UserSchedule(Pairs(), 4).groups(5)
        ((0, 3), (1, 2))
    """

    def __init__(self, schedule, world_size, window_steps=None, check_windows=2):
        if not callable(getattr(schedule, "groups", None)):
            raise TypeError(f"Arg ``schedule`` must be a name in {SCHEDULE_NAMES} or an object with a "
                            f"groups(step) method, got {schedule!r}.")
        self.user = schedule
        self.world_size = _check_int("world_size", world_size, 1)
        declared = getattr(schedule, "world_size", self.world_size)
        if declared != self.world_size:
            raise ValueError(f"schedule {schedule!r} is for world size {declared}, but the job has "
                             f"{self.world_size} ranks.")
        window_steps = getattr(schedule, "window_steps", window_steps)
        self.window_steps = None if window_steps is None else _check_int("window_steps", window_steps, 1)
        self._scan = 64 if self.window_steps is None else self.window_steps
        self._cache = {}
        for window in range(check_windows):
            self.partitions(window)

    def partitions(self, window):
        cached = self._cache.get(window)
        if cached is None:
            start = window * self._scan
            cycle = []
            for step in range(start, start + self._scan):
                first = self.user.groups(step)
                validate_partition(first, self.world_size, what=f"schedule.groups({step})")
                if canonical_partition(self.user.groups(step)) != canonical_partition(first):
                    raise ValueError(f"schedule.groups({step}) returned different partitions when called "
                                     "twice: a schedule must be a deterministic function of the step.")
                cycle.append(canonical_partition(first))
            cached = tuple(cycle)
            if self.window_steps is None:
                cached = cached[:self._period(cached)]
            self._cache = {window: cached}
        return cached

    @staticmethod
    def _period(cycle):
        # An endless window must repeat: groups(t) beyond the scan is taken from one period of the scan, so
        # the period must be seen at least twice in it, and wrapping must use the period, not the scan.
        for period in range(1, len(cycle) // 2 + 1):
            if all(cycle[i] == cycle[i % period] for i in range(len(cycle))):
                return period
        raise ValueError(f"a user schedule without ``window_steps`` must repeat with a period of at most "
                         f"{len(cycle) // 2} steps; give it a ``window_steps`` attribute otherwise.")

    def config(self):
        return {"name": "user", "world_size": self.world_size, "type": type(self.user).__qualname__,
                "window_steps": self.window_steps,
                "first_steps": [self.groups(t) for t in range(min(8, self._scan))]}
