"""Sparse averaging of embedding tables (:mod:`hvd_dssync.sparse`) for the Keras adapter.

The tables whose gradients are sparse are named when the step is traced; each rank notes the rows its
updates may change, and each average gathers the group's row sets and averages only the rows of their
union. The row sets live in Python (:class:`hvd_dssync.sparse.RowSets`), reached from the graph through
``tf.numpy_function``.
"""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..plan import ring_allreduce_bytes
from ..sparse import RowSets, allgather_bytes, id_dtype, pack_rows

__all__ = ["SparseRows", "changes_other_rows"]


class SparseRows:
    """The rows of the embedding tables that may differ between ranks.

    ``name`` names its ops; ``process_set`` is the optimizer's (the tables' equality is checked over it);
    ``average(values, process_set, kind)`` is the exact average the switch's branches use
    (:class:`.averaging.ExactAverage`). :meth:`average` gets the step's :class:`.switch.Switch`.

    Example::

        sparse = SparseRows("DSSyncSGD_0", hvd.global_process_set, ExactAverage("DSSyncSGD_0"))
        sparse.use([embedding.embeddings])          # when the step is traced
        started = sparse.start(first_pass)          # at the start of a step
        touched = sparse.touch([grad.indices])      # after the local update
        dense, averaged, writes, means = sparse.average(switch, variables, values, bits, branch)
    """

    def __init__(self, name, process_set, average):
        self.name = name
        self.process_set = process_set
        self.exact_average = average
        self._tables, self.row_sets = [], None
        self._checks = 0  # runs of the step whose equality check ran (see start)
        self.sparse_bytes = 0  # bytes sent by averages that moved rows (see average)

    def use(self, tables):
        """Average the embedding ``tables`` (variables whose gradients are sparse) over the rows that may differ.

        Called when the step is traced, with the same tables in the same order on every rank. The row sets
        start full, the safe superset, until :meth:`start` finds the tables equal on every rank.
        """
        tables = list(tables)
        if [t.ref() for t in tables] == [t.ref() for t in self._tables]:
            return
        self._tables = tables
        self.row_sets = RowSets({f"{k}:{t.name}": int(t.shape[0]) for k, t in enumerate(tables)}) if tables else None
        self._checks = 0
        if self.row_sets is not None:
            self.row_sets.fill()

    def restart(self):
        """After a change of world: every row may differ, and the next runs check again whether the tables are equal."""
        if self.row_sets is not None:
            self.row_sets.fill()
            self._checks = 0

    def positions(self):
        """``{table.ref(): position}`` of the tables averaged by their rows."""
        return {t.ref(): k for k, t in enumerate(self._tables)}

    def start(self, first_pass):
        """An op for the start of a step, before its update: in the first two steps this process runs, if the
        tables are equal on every rank, no row may differ: the row sets empty. Else they stay as they are
        (full from :meth:`use`, the safe superset, or what the steps since made of them).

        One small allreduce of the tables' fingerprints, in those two steps only. Two, because Horovod's Keras
        recipe broadcasts the variables after the first batch: ranks that started from different models are
        equal at the second step. A resumed job whose ranks load their own models keeps full sets.
        ``first_pass``: a boolean tensor, False for passes that continue a step (``backward_passes_per_step``).
        """
        if self.row_sets is None:
            return tf.no_op()

        def due(first):
            return np.bool_(bool(first) and self._checks < 2)

        def checked(equal):
            self._checks += 1
            if equal:
                self.row_sets.clear()
            return np.bool_(equal)

        def check():
            fingerprints = tf.concat([_fingerprint(t) for t in self._tables], 0)
            extremes = hvd.allreduce(tf.concat([fingerprints, -fingerprints], 0), op=hvd.Max, ignore_name_scope=True,
                                     name=f"{self.name}_rows_equal", process_set=self.process_set)
            n = len(self._tables) * 2
            equal = tf.reduce_all(tf.equal(extremes[:n], -extremes[n:]))  # the largest equals the smallest
            return tf.numpy_function(checked, [equal], tf.bool, stateful=True, name=f"{self.name}_rows_checked")

        need = tf.numpy_function(due, [first_pass], tf.bool, stateful=True, name=f"{self.name}_rows_due")
        need.set_shape([])
        return tf.cond(need, check, lambda: tf.constant(False))

    def touch(self, indices):
        """An op adding to the row sets the rows this rank's update may change: ``indices[k]``, the rows of the
        ``k``-th table's sparse gradient (an ``IndexedSlices``' indices)."""
        if self.row_sets is None:
            return tf.no_op()
        names = list(self.row_sets.tables)

        def touch(*rows):
            for name, r in zip(names, rows):
                self.row_sets.touch(name, r)
            return np.bool_(True)

        return tf.numpy_function(touch, [tf.cast(i, tf.int64) for i in indices], tf.bool, stateful=True,
                                 name=f"{self.name}_touch_rows")

    def forget(self):
        """After an exact average and broadcast over every rank (``synchronize_models``): no row may differ."""
        if self.row_sets is not None:
            self.row_sets.clear()

    def average(self, switch, variables, values, bits, branch):
        """The averaging switch with embedding tables averaged over the rows of the group's union.

        A communicating branch gathers the members' row sets (one allgather of ids), every member adopts
        the union (a global average empties the sets), and one grouped allreduce averages the dense
        variables and the union's rows of each table (its whole table when that is cheaper, see
        :func:`hvd_dssync.sparse.average_densely`). Returns the dense variables with their averages, the
        ``(table, indices, rows)`` to write, and the step bits' means. ``values`` holds the dense variables'
        values (None for the tables, whose rows are gathered from the variables).
        """
        positions = self.positions()
        tables = sorted((i for i, v in enumerate(variables) if v.ref() in positions),
                        key=lambda i: positions[variables[i].ref()])
        if len(tables) != len(self._tables):
            raise ValueError("hvd_dssync: the averaged variables leave out some of the embedding tables averaged "
                             "by their rows; average all of them or none.")
        dense = [i for i in range(len(variables)) if i not in tables]
        dense_bytes = sum(values[i].shape.num_elements() * values[i].dtype.size for i in dense)
        row_bytes = [variables[i].shape[1:].num_elements() * variables[i].dtype.size for i in tables]
        ids = id_dtype(self.row_sets.tables)

        def unite(gathered, size, is_global):
            # An empty union stands in as row 0, one row all the same: the graph's collective has a fixed arity.
            unions = self.row_sets.unite(gathered, stand_in=True)
            chosen = self.row_sets.to_average(unions)
            self.row_sets.averaged(unions, is_global)
            out = [np.arange(rows, dtype=np.int64) if chosen[name] is None else chosen[name]
                   for name, rows in self.row_sets.tables.items()]
            moved = dense_bytes + sum(len(index) * b for index, b in zip(out, row_bytes))
            self.sparse_bytes += ring_allreduce_bytes(int(size), moved) + allgather_bytes(int(size), gathered.nbytes)
            return out

        def keep():
            return ([tf.identity(values[i]) for i in dense]
                    + [tf.zeros([0, *variables[i].shape[1:]], variables[i].dtype) for i in tables]
                    + [tf.zeros([0], tf.int64) for _ in tables] + [tf.identity(bits)])

        def through(process_set, kind, size, is_global):
            def run():
                prefix = f"{self.name}_{kind}_{process_set.process_set_id}"
                mine = tf.numpy_function(lambda: pack_rows(self.row_sets), [], tf.as_dtype(ids), stateful=True,
                                         name=f"{prefix}_pack")
                mine.set_shape([None])
                gathered = hvd.allgather(mine, name=f"{prefix}_rows", ignore_name_scope=True, process_set=process_set)
                indices = tf.numpy_function(lambda g: unite(g, size, is_global), [gathered], [tf.int64] * len(tables),
                                            stateful=True, name=f"{prefix}_unite")
                for index in indices:
                    index.set_shape([None])
                rows = [tf.gather(variables[i], index) for i, index in zip(tables, indices)]
                *averaged, means = self.exact_average([values[i] for i in dense] + rows + [bits], process_set, kind)
                return averaged + list(indices) + [means]
            return run

        branches = [keep] + [through(*branch_set) for branch_set in switch.branch_sets()]
        out = tf.switch_case(branch, branches, name=f"{self.name}_switch")
        n, k = len(dense), len(tables)
        writes = [(variables[i], out[n + k + j], out[n + j]) for j, i in enumerate(tables)]
        return [variables[i] for i in dense], out[:n], writes, out[-1]


def _fingerprint(table):
    """Two float64 sums of ``table`` that equal tables share on every rank (same values, same arithmetic)."""
    x = tf.convert_to_tensor(table)
    x = tf.reshape(x, [x.shape[0], -1])
    mix = tf.cast(tf.range(x.shape[1]) % 7 + 1, x.dtype)
    weights = tf.cast(tf.range(x.shape[0]) % 65521 + 1, tf.float64)
    sums = tf.cast(tf.reduce_sum(x, 1), tf.float64)
    mixed = tf.cast(tf.reduce_sum(x * mix, 1), tf.float64)
    return tf.stack([tf.reduce_sum(sums * weights), tf.reduce_sum(mixed * tf.reverse(weights, [0]))])


def changes_other_rows(optimizer, dense_gradients):
    """Why ``optimizer`` may change rows of an embedding table outside its gradient's, or None if it cannot.

    Keras' SGD without momentum and Adagrad change only those rows, with sparse gradients and (a zero
    gradient moves nothing) dense ones; the legacy SGD's momentum is lazy, so only with sparse gradients.

    Example::

        changes_other_rows(tf.keras.optimizers.Adam(), dense_gradients=False)  # "Adam is not SGD or Adagrad"
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    name = type(inner).__name__
    if getattr(inner, "use_ema", False):
        return f"{name} with use_ema=True moves every row"
    if getattr(inner, "weight_decay", None):
        return f"{name} with weight_decay moves every row"
    legacy = isinstance(inner, tf.keras.optimizers.legacy.Optimizer)
    if isinstance(inner, (tf.keras.optimizers.Adagrad, tf.keras.optimizers.legacy.Adagrad)):
        return None
    if isinstance(inner, (tf.keras.optimizers.SGD, tf.keras.optimizers.legacy.SGD)):
        momentum = inner.get_config().get("momentum", 0.0)
        if not momentum or (legacy and not dense_gradients):
            return None
        if legacy:
            return (f"{name}'s momentum moves every row once its gradients are dense (warmup_steps or "
                    "backward_passes_per_step)")
        return f"{name}'s momentum moves every row (the legacy SGD's is lazy)"
    return f"{name} is not SGD or Adagrad"
