"""The DS-Sync optimizers alive in this process, and the counters that name their ops.

The optimizer registers itself here; :func:`hvd_dssync.torch.synchronize_models`, the exit drain and
``hvd.join()`` reach the optimizers through this module, which imports no other part of the adapter.
"""
import collections
import itertools
import weakref

__all__ = ["live_optimizers", "finish_pending_averages", "op_prefix", "note_construction", "note_step",
           "in_training"]

# Every DS-Sync optimizer built in this process and not yet collected.
live_optimizers = weakref.WeakSet()
# Each optimizer's ops carry its process set and its number in construction order among the optimizers of
# that set, the same on every member (ranks outside a set build none of its optimizers), so that two
# optimizers' averages in flight at once never share an op name.
_construction_order = collections.defaultdict(itertools.count)
_constructions = itertools.count()
_constructed = weakref.WeakKeyDictionary()  # optimizer: its number in construction order, any process set
# Every optimizer's step() calls, counted together: the order in which a training loop steps its optimizers.
_step_ticks = itertools.count()
_ticks = weakref.WeakKeyDictionary()  # optimizer: (the tick of its step() before the last, of its last)


def op_prefix(process_set_id):
    """The prefix of the op names of the next optimizer built on the process set ``process_set_id``.

    Example::

        op_prefix(0)      # "dssync.0" for the first optimizer of the job, "dssync.1" for the second
    """
    number = next(_construction_order[process_set_id])
    return f"dssync.{number}" if process_set_id == 0 else f"dssync.set{process_set_id}.{number}"


def note_construction(optimizer):
    """Count ``optimizer`` as the next one built in this process, on any process set.

    Example::

        note_construction(self)      # in the optimizer's constructor
    """
    _constructed[optimizer] = next(_constructions)


def note_step(optimizer):
    """Count a call to ``optimizer``'s ``step()`` among every optimizer's calls in this process.

    Example::

        note_step(self)              # at each training step
    """
    _ticks[optimizer] = (_ticks.get(optimizer, (None, None))[1], next(_step_ticks))


def in_training():
    """The live optimizers stepped in the last training iteration (since the last-stepped one's step before
    that), in the order they were stepped; where none has stepped yet, every live one in construction order.

    Example::

        for optimizer in in_training():   # hvd.join(): serve the averages of these
            ...
    """
    live = [o for o in live_optimizers if o in _constructed]
    stepped = sorted((o for o in live if o in _ticks), key=lambda o: _ticks[o][1])
    if not stepped:  # a rank without a single batch: every optimizer it built, in the order it built them
        return sorted(live, key=lambda o: _constructed[o])
    since = _ticks[stepped[-1]][0]
    return [o for o in stepped if since is None or _ticks[o][1] > since]


def finish_pending_averages():
    """Fold in every averaging still in flight (``overlap=True``), each rank waiting for its own ops.

    Example::

        finish_pending_averages()     # before reading the models, e.g. in synchronize_models
    """
    for optimizer in list(live_optimizers):
        optimizer.finish_pending()
