"""The adaptive policy's settings: :class:`AdaptivePolicy`, validated once, with the errors naming the argument."""
import math

__all__ = ["AdaptivePolicy"]


def _positive(name, value, integer=True, allow_zero=False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (value >= 0 if allow_zero else value > 0) \
            or not math.isfinite(value):
        rule = ("a non-negative" if allow_zero else "a positive") + (" integer" if integer else " number")
        raise ValueError(f"Arg ``{name}`` must be {rule}, got {value!r}.")
    return value


class AdaptivePolicy:
    """The adaptive policy's settings (``policy="adaptive"`` takes the defaults). Validated here.

    Args:
        decide_every: steps per window; every rank decides at the last step of each window. A multiple
            of every period the policy may choose.
        max_period: the longest averaging period (``average_every``) it may choose; the shortest is the
            optimizer's ``average_every``. Periods double and halve between the two.
        probe_every: under group averaging, the last average of every ``probe_every``-th window is global
            (a probe), so the global figure stays fresh and the policy can decide. The first window has
            none: its group averages stand in for it (see :func:`decide`).
        enter_gain, leave_gain: switch to group averaging when it would make an averaging period at least
            ``enter_gain`` (a fraction) shorter than global averaging; back to global averaging when the
            gain falls below ``leave_gain`` (the gap between the two keeps the policy from flapping).
            A group average mixes the models less than a global one, which the default gain of 30% pays for.
        raise_ratio, lower_ratio: at ``2**k`` times the shortest period, double the period when the chosen
            mode's average costs at least ``raise_ratio * 2**k`` times the least it has cost in this job;
            halve it when at most ``lower_ratio * 2**(k-1)`` times (the gap keeps it from flapping).
        drift_bound: when the largest relative distance between the models of a group before averaging
            (``|x_i - mean| / |mean|``, measured by the averages themselves) exceeds it, the next window
            ends with a global average (a probe), without waiting for the ``probe_every``-th. ``None``: never.
        switch_early: under global averaging, also switch to group averages at a global average inside a
            window, from the figures of the period before it (the least compute time of its steps, the last
            global average's time), when they say so at two such averages in a row, or at one when group
            averages would save at least halfway from ``enter_gain`` to all of a period; so a slowed link is
            answered within periods, not at the window's end (PyTorch; the Keras adapter decides at windows'
            ends only). ``True``: the figures ride along that average, and the switch follows it;
            ``"exchange"``: the ranks exchange them just before it in a small allreduce, and the switch
            makes that very average a group one; ``False``: decide at windows' ends only.
        first_period: the period of the first window, before anything was measured; ``None`` (the default):
            ``max_period``. Its averages are group averages whose cost the ranks do not know yet, and on a
            fast network they cost more than the global ones that follow (Horovod negotiates every process
            set on every cycle), so the first window makes few: with ``decide_every=16`` and
            ``average_every=4``, two (the last step inside the racks and a bridge) instead of four
            (docs/tuning.md has what that saved on the bench). The models drift apart a little more in the
            first window; every later window starts from the shortest period (``average_every``).

    Example::

        >>> AdaptivePolicy(decide_every=16, max_period=4).config()["decide_every"]
        16
        >>> AdaptivePolicy(decide_every=6, max_period=4)
        Traceback (most recent call last):
        ...
        ValueError: Arg ``decide_every`` must be a multiple of every period the policy may choose (1, 2, 4), got 6.
    """

    def __init__(self, decide_every=64, max_period=8, probe_every=4, enter_gain=0.3, leave_gain=0.1,
                 raise_ratio=2.0, lower_ratio=1.5, drift_bound=0.05, min_period=1, switch_early=True,
                 first_period=None):
        self.decide_every = _positive("decide_every", decide_every)
        self.min_period = _positive("average_every", min_period)
        self.max_period = _positive("max_period", max_period)
        if max_period < min_period:
            raise ValueError(f"Arg ``max_period`` must be at least average_every ({min_period}), got {max_period}.")
        self.probe_every = _positive("probe_every", probe_every)
        for name, value in (("enter_gain", enter_gain), ("leave_gain", leave_gain)):
            _positive(name, value, integer=False, allow_zero=True)
            if value >= 1:
                raise ValueError(f"Arg ``{name}`` must be a fraction in [0, 1), got {value!r}.")
        if leave_gain > enter_gain:
            raise ValueError(f"Arg ``leave_gain`` ({leave_gain}) must not exceed ``enter_gain`` ({enter_gain}).")
        for name, value in (("raise_ratio", raise_ratio), ("lower_ratio", lower_ratio)):
            _positive(name, value, integer=False)
            if value <= 1:
                raise ValueError(f"Arg ``{name}`` must be a ratio above 1, got {value!r}.")
        if lower_ratio > raise_ratio:
            raise ValueError(f"Arg ``lower_ratio`` ({lower_ratio}) must not exceed ``raise_ratio`` ({raise_ratio}).")
        self.enter_gain, self.leave_gain = float(enter_gain), float(leave_gain)
        self.raise_ratio, self.lower_ratio = float(raise_ratio), float(lower_ratio)
        self.drift_bound = None if drift_bound is None else float(_positive("drift_bound", drift_bound, integer=False))
        if not (isinstance(switch_early, bool) or switch_early == "exchange"):
            raise ValueError(f"Arg ``switch_early`` must be True, False or 'exchange', got {switch_early!r}.")
        self.switch_early = switch_early
        periods = self.periods()
        self.first_period = self.max_period if first_period is None else _positive("first_period", first_period)
        if self.first_period not in periods:
            raise ValueError(f"Arg ``first_period`` must be one of the periods the policy may choose "
                             f"({', '.join(map(str, periods))}), got {first_period!r}.")
        if any(decide_every % p for p in periods):
            raise ValueError(f"Arg ``decide_every`` must be a multiple of every period the policy may choose "
                             f"({', '.join(map(str, periods))}), got {decide_every}.")

    def periods(self):
        """The periods the policy may choose: ``min_period`` doubled up to ``max_period``."""
        out = [self.min_period]
        while out[-1] < self.max_period:
            out.append(min(2 * out[-1], self.max_period))
        return tuple(out)

    def first_averages(self):
        """The averages of the first window: ``decide_every / first_period``."""
        return self.decide_every // self.first_period

    def config(self):
        return {"decide_every": self.decide_every, "min_period": self.min_period, "max_period": self.max_period,
                "probe_every": self.probe_every, "enter_gain": self.enter_gain, "leave_gain": self.leave_gain,
                "raise_ratio": self.raise_ratio, "lower_ratio": self.lower_ratio, "drift_bound": self.drift_bound,
                "switch_early": self.switch_early, "first_period": self.first_period}

    @classmethod
    def resolve(cls, policy, average_every=1, global_every=0):
        """The settings an optimizer's ``policy`` argument asks for: ``None`` (fixed) or an :class:`AdaptivePolicy`.

        ``policy`` is None or "fixed" (the fixed :class:`hvd_dssync.policy.Policy`), "adaptive" (the
        defaults, at least ``average_every`` steps apart) or an :class:`AdaptivePolicy`; a dict is its
        :meth:`config`. No communication.

        Example::

            >>> AdaptivePolicy.resolve("adaptive", average_every=2).periods()
            (2, 4, 8, 16)
            >>> AdaptivePolicy.resolve("fixed") is None
            True
        """
        if policy is None or policy == "fixed":
            return None
        if policy == "adaptive":
            policy = cls(decide_every=64 * average_every, min_period=average_every, max_period=8 * average_every)
        elif isinstance(policy, dict):
            policy = cls(**policy)
        elif not isinstance(policy, cls):
            raise ValueError(f"Arg ``policy`` must be None, 'fixed', 'adaptive' or an AdaptivePolicy, got {policy!r}.")
        if policy.min_period != average_every:
            policy = cls(**{**policy.config(), "min_period": average_every})
        if global_every:
            raise ValueError("Arg ``global_every`` must be 0 with policy='adaptive': the policy decides when to "
                             "average globally.")
        return policy

    def __repr__(self):
        return "AdaptivePolicy(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"
