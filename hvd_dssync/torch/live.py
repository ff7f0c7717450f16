"""The DS-Sync optimizers alive in this process, and the counters that name their ops.

The optimizer registers itself here; :func:`hvd_dssync.torch.synchronize_models`, the exit drain and
``hvd.join()`` reach the optimizers through this module, which imports no other part of the adapter.
"""
import collections
import itertools
import weakref

__all__ = ["live_optimizers", "finish_pending_averages", "op_prefix", "next_construction", "next_step_tick"]

# Every DS-Sync optimizer built in this process and not yet collected.
live_optimizers = weakref.WeakSet()
# Each optimizer's ops carry its process set and its number in construction order among the optimizers of
# that set, the same on every member (ranks outside a set build none of its optimizers), so that two
# optimizers' averages in flight at once never share an op name.
_construction_order = collections.defaultdict(itertools.count)
_constructions = itertools.count()
# Every optimizer's step() calls, counted together: the order in which a training loop steps its optimizers.
_step_ticks = itertools.count()


def op_prefix(process_set_id):
    """The prefix of the op names of the next optimizer built on the process set ``process_set_id``.

    Example::

        op_prefix(0)      # "dssync.0" for the first optimizer of the job, "dssync.1" for the second
    """
    number = next(_construction_order[process_set_id])
    return f"dssync.{number}" if process_set_id == 0 else f"dssync.set{process_set_id}.{number}"


def next_construction():
    """The number of the next optimizer built in this process, on any process set.

    Example::

        constructed = next_construction()
    """
    return next(_constructions)


def next_step_tick():
    """The number of the next call to any optimizer's ``step()`` in this process.

    Example::

        tick = next_step_tick()
    """
    return next(_step_ticks)


def finish_pending_averages():
    """Fold in every averaging still in flight (``overlap=True``); a collective on every rank.

    Example::

        finish_pending_averages()     # before reading the models, e.g. in synchronize_models
    """
    for optimizer in list(live_optimizers):
        optimizer.finish_pending()
