"""Rows of embedding tables that may differ between ranks, so that an average moves only those rows.

An embedding table of a recommendation or language model is mostly rows that no step touched. A row that
no rank has changed since the last exact global average holds the same value on every rank, so averaging
it moves nothing. Each rank keeps, per table, a set of rows that may differ (:class:`RowSets`) under one
invariant:

    for every row, all the ranks that do not hold it in their set hold the same value.

- A local step adds the rows it changed to the rank's set.
- A group gathers its members' sets, averages the rows of their union, and every member adopts the union.
  Rows outside the union were equal among the members (by the invariant) and still are. Members hold the
  average of the rows inside it and keep them in their sets, so the invariant still holds.
- A global average over the union of every rank's set leaves every row equal everywhere: the sets empty.
- Any superset of a rank's set is safe. That is why a rank that cannot know its set (a checkpoint saved
  without sets) starts from every row.

The result is the dense average exactly, up to the collective's own arithmetic. Its cost is
proportional to the rows in play. When a union passes :data:`DENSE_FRACTION` of its table, the whole table
is averaged instead: moving the ids and gathering the rows then costs about as much as the table.

Framework-free: each adapter gathers the ids and moves the rows; the rules are here, an average's
bookkeeping included (:meth:`RowSets.unite`, :meth:`RowSets.to_average`, :meth:`RowSets.averaged`).
"""
import numpy as np

__all__ = ["RowSets", "DENSE_FRACTION", "id_dtype", "pack_rows", "unpack_unions", "average_densely", "allgather_bytes"]

# A union larger than this fraction of its table is averaged as the whole table.
DENSE_FRACTION = 0.5


class RowSets:
    """Per table, the rows this rank holds that may differ from the other ranks' (see the module).

    Args:
        tables: ``{name: number of rows}``, in the same order on every rank.

    Example::

        >>> sets = RowSets({"emb": 6})
        >>> sets.touch("emb", [4, 1, 4])
        >>> sets.rows("emb").tolist()
        [1, 4]
        >>> sets.adopt("emb", np.array([1, 2, 4]))
        >>> sets.size("emb"), sets.total()
        (3, 3)
        >>> sets.clear()
        >>> sets.total()
        0
    """

    def __init__(self, tables):
        self.tables = dict(tables)
        self._masks = {name: np.zeros(rows, dtype=bool) for name, rows in self.tables.items()}

    def touch(self, name, rows):
        """Rows of table ``name`` that this rank changed."""
        self._masks[name][np.asarray(rows, dtype=np.int64)] = True

    def rows(self, name):
        """The rows of table ``name`` in this rank's set, sorted."""
        return np.flatnonzero(self._masks[name]).astype(np.int64)

    def size(self, name):
        return int(np.count_nonzero(self._masks[name]))

    def total(self):
        return sum(self.size(name) for name in self.tables)

    def adopt(self, name, union):
        """After a group average over ``union``: exactly those rows may still differ."""
        mask = self._masks[name]
        mask[:] = False
        mask[union] = True

    def unite(self, gathered, stand_in=False):
        """The group's union of every table, ``{name: sorted rows}``, from its members' :func:`pack_rows`
        gathered (the same on every member; see :func:`unpack_unions`).

        An empty union (every member holds the table equal) stays empty, and the table has nothing to send;
        with ``stand_in``, it becomes row 0 instead, for an average that needs at least one row of each table
        (a row equal on every member averages to itself, and a larger set is always safe).

        Example::

            >>> sets = RowSets({"a": 3, "b": 4})
            >>> gathered = np.array([-1, 2, -1])
            >>> {name: rows.tolist() for name, rows in sets.unite(gathered).items()}
            {'a': [2], 'b': []}
            >>> sets.unite(gathered, stand_in=True)["b"].tolist()
            [0]
        """
        unions = unpack_unions(gathered, self.tables)
        if stand_in:
            unions = {name: union if len(union) else np.zeros(1, np.int64) for name, union in unions.items()}
        return unions

    def to_average(self, unions, fraction=DENSE_FRACTION):
        """What an average moves of each table, given the group's ``unions`` (:meth:`unite`): ``{name: rows}``,
        the union's rows, or None where the whole table is cheaper (:func:`average_densely`).

        Example::

            >>> sets = RowSets({"a": 10, "b": 4})
            >>> sets.to_average({"a": np.array([1, 7]), "b": np.array([0, 1, 3])})["b"] is None
            True
        """
        return {name: None if average_densely(len(union), self.tables[name], fraction) else union
                for name, union in unions.items()}

    def averaged(self, unions, is_global):
        """After an average over the group's ``unions`` (:meth:`unite`): a group's member adopts them
        (:meth:`adopt`); a global average, exact over every rank, leaves every row equal and empties the sets.

        Example::

            >>> sets = RowSets({"a": 5})
            >>> sets.touch("a", [1])
            >>> sets.averaged({"a": np.array([1, 3])}, is_global=False)
            >>> sets.rows("a").tolist()
            [1, 3]
            >>> sets.averaged({"a": np.array([1, 3])}, is_global=True)
            >>> sets.total()
            0
        """
        if is_global:
            self.clear()
            return
        for name, union in unions.items():
            self.adopt(name, union)

    def clear(self):
        """After an exact global average: every row is equal on every rank."""
        for mask in self._masks.values():
            mask[:] = False

    def fill(self):
        """Every row may differ: the safe start when this rank cannot know its set."""
        for mask in self._masks.values():
            mask[:] = True

    def state_dict(self):
        return {name: self.rows(name) for name in self.tables}

    def load_state_dict(self, state):
        """Restore sets saved by :meth:`state_dict`; a table missing from ``state`` gets every row."""
        for name, mask in self._masks.items():
            if name in state:
                mask[:] = False
                mask[np.asarray(state[name], dtype=np.int64)] = True
            else:
                mask[:] = True


def id_dtype(tables):
    """The integer type of :func:`pack_rows`' ids for ``tables`` (``{name: rows}``): int32 while every id fits,
    half the bytes of int64 on the wire, else int64. The same on every rank, as the tables are.

    Example::

        >>> id_dtype({"a": 1000000}), id_dtype({"a": 2 ** 31})
        (dtype('int32'), dtype('int64'))
    """
    return np.dtype(np.int32 if sum(tables.values()) < 2 ** 31 else np.int64)


def pack_rows(sets):
    """This rank's rows of every table as one integer array (:func:`id_dtype`) for one allgather.

    Row ``r`` of the ``k``-th table becomes ``offset_k + r``, with the tables' rows laid end to end. A
    leading ``-1`` makes every rank send at least one element, even with empty sets.

    Example::

        >>> sets = RowSets({"a": 3, "b": 4})
        >>> sets.touch("a", [2]); sets.touch("b", [0, 3])
        >>> pack_rows(sets).tolist()
        [-1, 2, 3, 6]
    """
    offsets = np.cumsum([0] + list(sets.tables.values())[:-1])
    parts = [np.array([-1], dtype=np.int64)]
    parts += [sets.rows(name) + offset for name, offset in zip(sets.tables, offsets)]
    return np.concatenate(parts).astype(id_dtype(sets.tables), copy=False)


def unpack_unions(gathered, tables):
    """``{name: sorted rows}``: the union of the members' :func:`pack_rows`, the same on every member.

    Example::

        >>> unions = unpack_unions(np.array([-1, 2, 3, -1, 6, 3]), {"a": 3, "b": 4})
        >>> {name: rows.tolist() for name, rows in unions.items()}
        {'a': [2], 'b': [0, 3]}
    """
    # A mask over every table's rows, not a sort: linear in the tables, and several times faster for the
    # hundreds of thousands of ids a group gathers.
    seen = np.zeros(sum(tables.values()), dtype=bool)
    gathered = np.asarray(gathered, dtype=np.int64)
    seen[gathered[gathered >= 0]] = True
    ids = np.flatnonzero(seen)
    out, start = {}, 0
    for name, rows in tables.items():
        lo, hi = np.searchsorted(ids, [start, start + rows])
        out[name] = ids[lo:hi] - start
        start += rows
    return out


def average_densely(union_rows, table_rows, fraction=DENSE_FRACTION):
    """Whether a union of ``union_rows`` rows is cheaper averaged as the whole table of ``table_rows``.

    Example::

        >>> average_densely(10, 1000), average_densely(600, 1000)
        (False, True)
    """
    return union_rows > fraction * table_rows


def allgather_bytes(group_size, total_bytes):
    """Bytes one rank sends in a ring allgather whose result is ``total_bytes``.

    Example::

        >>> allgather_bytes(4, 800)
        600
    """
    return total_bytes * (group_size - 1) // group_size if group_size > 1 else 0
