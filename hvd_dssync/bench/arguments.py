"""The argparse types that the command line, the bench and its experiments share: each rule written once,
each error naming the option's value and what it may be (argparse adds the option's name).

Example::

    p.add_argument("--scenarios", type=names("scenario", SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--rows", type=integers("row", 1, 5), default=[1, 2, 3, 4, 5])
    p.add_argument("--cycle-time-ms", type=positive_float, default=None)
"""
import argparse

__all__ = ["names", "integers", "positive_float"]


def names(kind, choices=None):
    """A type for comma-separated names (``"a,b"``); with ``choices``, each among them, and ``all`` for all.

    Example::

        >>> names("scenario", ("static", "dynamic"))("all")
        ['static', 'dynamic']
        >>> names("scenario", ("static", "dynamic"))("static,bad")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: unknown scenario bad; choose from static, dynamic
    """
    def parse(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        if choices is not None:
            if items == ["all"]:
                return list(choices)
            bad = [i for i in items if i not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(bad)}; choose from {', '.join(choices)}")
        return items
    return parse


def integers(kind, low=None, high=None):
    """A type for comma-separated integers (``"2,5"``), sorted, each once, each within ``[low, high]``.

    Example::

        >>> integers("row", 1, 5)("5,2,2")
        [2, 5]
        >>> integers("row", 1, 5)("2,6")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected rows among 1-5, comma-separated, got '2,6'
    """
    span = f" among {low}-{high}" if low is not None and high is not None else \
        f" from {low} on" if low is not None else f" up to {high}" if high is not None else ""

    def parse(text):
        try:
            values = sorted({int(s) for s in text.split(",")})
        except ValueError:
            values = []
        if not values or (low is not None and values[0] < low) or (high is not None and values[-1] > high):
            raise argparse.ArgumentTypeError(f"expected {kind}s{span}, comma-separated, got {text!r}")
        return values
    return parse


def positive_float(text):
    """A type for a number above 0.

    Example::

        >>> positive_float("2.5")
        2.5
        >>> positive_float("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected a positive number, got '0'
    """
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
