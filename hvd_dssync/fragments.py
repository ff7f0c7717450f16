"""A global average in flight in fragments: how many, and which part of the model each one sends.

A global average in flight is folded in a step after it started (:func:`hvd_dssync.overlap.folds_now`), and a
ring over every rank of the whole model does not hide behind one local step. So it goes in fragments: as many
parts of the model, each sent at a step of its own and folded in at the next, as it takes for each ring to hide
behind a step (:func:`global_fragments`), at most one a step until the next average. Both adapters cut the model
by :func:`fragment_ranges`: the PyTorch adapter anywhere in a tensor, the Keras adapter between the rows of a
variable (a traced step writes a slice of rows, not a run of elements).

Numpy only.
"""
import math

import numpy as np

__all__ = ["global_fragments", "fragment_count", "fragment_ranges", "row_sizes", "row_fragments", "forced_fragments",
           "FRAGMENTS_ENV", "GLOBAL_FOLD_STEPS"]

# overlap=True: how many fragments a global average in flight is split into (on every rank alike; 1 unless set).
FRAGMENTS_ENV = "HVD_DSSYNC_GLOBAL_FRAGMENTS"
# A global average in flight (or a fragment of one) is folded in at most this many steps after it started, waited
# for there (hvd_dssync.overlap.folds_now).
GLOBAL_FOLD_STEPS = 1


def global_fragments(route_cost, local_step, world_size, period, through_racks=True, headroom=1.0):
    """How many fragments a global average in flight is split into (0: none goes in flight; it is waited for).
    Each fragment of the model is sent at a step of its own, one after the other, and folded in at the next step
    (:func:`hvd_dssync.overlap.folds_now`): a ring over every rank of ``1/n`` of the model hides behind one local
    step where one of the whole model would not.

    ``route_cost`` is what a waited global average added to its period, in seconds. ``through_racks`` (the
    PyTorch adapter's route): it went through the racks, and a ring over ``w`` ranks sends ``2 (w - 1) / w`` bytes
    across a link for each byte the route's bridge sends, so the ring's time is taken as the route's times that;
    else (the Keras adapter) the waited average was that ring. ``n`` is the ring's time over the
    :data:`GLOBAL_FOLD_STEPS` local steps (``local_step``) a fragment may hide behind, at most
    ``period`` (the last fragment is folded in where the next average starts at the latest); 1 where one ring
    hides. What ``period`` fragments leave exposed is waited for at their folds: in flight only where that is less
    than the waited average's whole cost. Nothing timed (NaN): waited. ``headroom``: so many times more fragments
    (at most ``period``), each then a shorter ring, where a ring in flight may take longer than timed alone; what
    they leave exposed is still weighed at the ring's time.

    Example::

        >>> global_fragments(0.05, 0.13, 4, 8), global_fragments(0.09, 0.13, 4, 8), global_fragments(0.67, 0.14, 4, 8)
        (1, 2, 8)
        >>> global_fragments(0.38, 0.012, 8, 8), global_fragments(float("nan"), 0.14, 4, 8)   # the static cluster
        (0, 0)
        >>> global_fragments(0.38, 0.012, 8, 8, through_racks=False)   # the ring itself, waited: 8 expose less
        8
        >>> global_fragments(0.5, 0.15, 4, 8), global_fragments(0.5, 0.15, 4, 8, headroom=2.0)
        (5, 8)
    """
    share = 2.0 * (world_size - 1) / world_size if world_size > 1 and through_racks else 1.0
    hiding = GLOBAL_FOLD_STEPS * local_step
    need = share * route_cost / hiding if hiding > 0 else math.nan
    if not math.isfinite(need):
        return 0
    most = max(1, int(period))
    fitting = min(max(1, math.ceil(need - 1e-9)), most)  # each ring within a step, as far as the period allows
    if not share * route_cost - fitting * hiding < route_cost:
        return 0
    return min(max(fitting, math.ceil(headroom * need - 1e-9)), most)


def fragment_count(count, steps):
    """How many fragments a global average goes in, given ``count`` (the trial's or the forced one): at most one a
    step until the next average, ``steps`` steps on (:meth:`hvd_dssync.policy.Policy.steps_to_next_average`; 1 or
    less: whole).

    Example::

        >>> fragment_count(8, 8), fragment_count(12, 8), fragment_count(0, 8)
        (8, 8, 0)
    """
    return min(int(count), int(steps))


def fragment_ranges(sizes, count, rows=None):
    """The parts of a model that each of ``count`` fragments of a global average sends (:func:`global_fragments`),
    in order: for each fragment, ``(tensor, start, stop)``, element ranges of the flattened tensors (``sizes``:
    each tensor's elements), the fragments as nearly equal as the elements allow and never empty (at most one
    fragment an element). ``rows``: each tensor's elements in a row (its first dimension's stride); a fragment
    then ends only between two rows, and where whole rows do not leave ``count`` fragments, there are fewer.

    Example::

        >>> fragment_ranges([10, 2], 3)
        [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10), (1, 0, 2)]]
        >>> fragment_ranges([1, 1], 4)
        [[(0, 0, 1)], [(1, 0, 1)]]
        >>> fragment_ranges([10, 2], 3, rows=[2, 1])   # five rows of 2, then two of 1
        [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10), (1, 0, 2)]]
        >>> fragment_ranges([10, 2], 3, rows=[5, 1])   # two rows of 5: no third fragment
        [[(0, 0, 5)], [(0, 5, 10), (1, 0, 2)]]
    """
    sizes = [int(n) for n in sizes]
    total = sum(sizes)
    count = max(1, min(int(count), total))
    offsets = np.cumsum([0] + sizes)
    bounds = [k * total // count for k in range(count + 1)]
    if rows is not None:  # each inner bound moved down to the start of the row it falls in
        def row_start(bound):
            i = int(np.searchsorted(offsets, bound, side="right")) - 1
            step = max(1, int(rows[i])) if i < len(sizes) else 1
            return int(offsets[i]) + (bound - int(offsets[i])) // step * step

        bounds = sorted({0, total, *(row_start(b) for b in bounds[1:-1])})
    fragments = []
    for low, high in zip(bounds, bounds[1:]):
        spans = [(i, max(low, int(offsets[i])), min(high, int(offsets[i + 1]))) for i in range(len(sizes))]
        fragments.append([(i, a - int(offsets[i]), b - int(offsets[i])) for i, a, b in spans if a < b])
    return [parts for parts in fragments if parts]


def row_sizes(shapes):
    """Each tensor's elements in a row of its first axis, for tensors of ``shapes`` (a scalar's one element is its
    row): what :func:`row_fragments` cuts between.

    Example::

        >>> row_sizes([(4, 3), (3,), ()])
        [3, 1, 1]
    """
    return [max(1, int(np.prod(shape[1:]))) for shape in shapes]


def row_fragments(shapes, count):
    """:func:`fragment_ranges` of tensors of ``shapes``, cut between the rows of their first axis
    (:func:`row_sizes`): each part is then a slice of rows, ``(tensor, start, stop)`` in elements.

    Example::

        >>> row_fragments([(4, 3), (3,)], 2)
        [[(0, 0, 6)], [(0, 6, 12), (1, 0, 3)]]
    """
    return fragment_ranges([int(np.prod(shape)) for shape in shapes], count, row_sizes(shapes))


def forced_fragments(environ):
    """How many fragments ``overlap=True`` splits a global average in flight into: :data:`FRAGMENTS_ENV`, a
    whole number of 1 or more (set alike on every rank), else 1. A clear error names a bad value.

    Example::

        >>> forced_fragments({}), forced_fragments({"HVD_DSSYNC_GLOBAL_FRAGMENTS": "8"})
        (1, 8)
    """
    value = environ.get(FRAGMENTS_ENV, "").strip()
    if not value:
        return 1
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"hvd_dssync: {FRAGMENTS_ENV}={value!r}: expected a whole number of fragments, 1 or more")
    return count
