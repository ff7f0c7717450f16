"""Sparse averaging of embedding tables (:mod:`hvd_dssync.sparse`) for the PyTorch adapter.

Which tables are averaged sparsely is agreed at the first step after the warm-up (until then every rank's
model is the same); from then on each rank notes the rows its updates may change, and each average
gathers the group's row sets and averages only the rows of their union.
"""
import warnings

import horovod.torch as hvd
import torch

from ..plan import GLOBAL
from ..sparse import RowSets, allgather_bytes, pack_rows
from . import collectives

__all__ = ["SparseRows"]


class SparseRows:
    """The rows of the embedding tables that may differ between ranks.

    ``optimizer`` (its class, param groups and state) and the gradients of ``named_parameters`` tell which
    rows a step changed; ``name``: the optimizer's op names. ``enabled``: sparse averaging is on (off with
    overlap or a lossy compression).

    Example::

        sparse = SparseRows(optimizer, model.named_parameters(), "dssync.0", enabled=True)
        sparse.agree(process_set)       # once, at the first averaging step (a collective)
        sparse.note_changed()           # after each local update
        named, writes, nbytes, unions = sparse.rows_to_average(named, action, process_set, name)
        sparse.averaged(unions, action)  # after the average, its rows written back
    """

    def __init__(self, optimizer, named_parameters, name, enabled):
        self.optimizer = optimizer
        self.named_parameters = list(named_parameters)
        self.name = name
        self.enabled = enabled
        self.tables = None  # {name: parameter} once agreed
        self.row_sets = None
        self._loaded = None  # sets from load_state_dict(), applied when the tables are agreed

    def agree(self, process_set):
        """Agree with every rank of ``process_set`` on the tables averaged sparsely (one small allreduce, once).

        A table qualifies if some rank saw a sparse gradient for it and no rank's optimizer can change rows
        outside what :meth:`changed_rows` reports. Ranks whose table got no gradient this step still
        agree, since the flags are reduced with max.
        """
        params = [p for _, p in self.named_parameters]
        seen = [float(p.grad is not None and p.grad.is_sparse) for p in params]
        unsupported = [float(s and self.changed_rows(p) is None) for s, p in zip(seen, params)]
        flags = hvd.allreduce(torch.tensor(seen + unsupported), name=f"{self.name}.sparse", op=hvd.Max,
                              process_set=process_set)
        n = len(params)
        self.tables = {name: p for k, (name, p) in enumerate(self.named_parameters)
                       if flags[k] and not flags[n + k]}
        skipped = [name for k, (name, _) in enumerate(self.named_parameters) if flags[k] and flags[n + k]]
        if skipped:
            warnings.warn(f"hvd_dssync: {', '.join(skipped)} averaged densely: sparse averaging needs an optimizer "
                          "that changes only the rows it reports (SGD, SparseAdam, Adagrad), not "
                          f"{type(self.optimizer).__name__} with these settings.")
        self._start()

    def _start(self):
        if not self.tables:
            self.row_sets = None
            return
        self.row_sets = RowSets({name: p.shape[0] for name, p in self.tables.items()})
        if self._loaded is not None:
            self.row_sets.load_state_dict(self._loaded)

    def forget(self):
        """The world changed and elastic Horovod broadcast rank 0's model: no row differs, and the ranks agree
        on the tables again at the next averaging step."""
        self.tables = self.row_sets = self._loaded = None

    def changed_rows(self, p):
        """Rows of table ``p`` that this step's update may have changed, or None if the optimizer can change
        others. Read after the step: SGD with momentum moves every row still in its (sparse) buffer."""
        optimizer = self.optimizer
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        if isinstance(optimizer, torch.optim.SGD) and not group.get("weight_decay"):
            if not group.get("momentum"):
                return _gradient_rows(p)
            buffer = optimizer.state.get(p, {}).get("momentum_buffer")
            if buffer is None:
                return _gradient_rows(p)
            return buffer.coalesce().indices()[0].numpy() if buffer.is_sparse else None
        if isinstance(optimizer, (torch.optim.SparseAdam, torch.optim.Adagrad)) and not group.get("weight_decay"):
            return _gradient_rows(p)
        return None

    def note_changed(self):
        """Add the rows this step's local update may have changed to this rank's row sets."""
        if self.row_sets is None:
            return
        for name, p in self.tables.items():
            rows = self.changed_rows(p)
            if rows is not None and len(rows):
                self.row_sets.touch(name, rows)

    def rows_to_average(self, named, action, process_set, name):
        """Gather the group's row sets; put in place of each sparse table the rows of the union (or the whole
        table where that is cheaper). Returns the tensors to average, the ``(table, index, rows)`` to write back
        after the average, the bytes the gathering sent, and the unions, for :meth:`averaged`."""
        mine = torch.from_numpy(pack_rows(self.row_sets))
        gathered = collectives.allgather(mine, name=f"{name}.rows", process_set=process_set)
        gathered_bytes = allgather_bytes(len(action.group), gathered.numel() * gathered.element_size())
        unions = self.row_sets.unite(gathered.numpy())
        moved = self.row_sets.to_average(unions)
        out, writes = [], []
        for tensor_name, tensor in named:
            rows = moved.get(tensor_name)
            if rows is None:  # not a table, or the whole table is cheaper
                out.append((tensor_name, tensor))
            elif len(rows):
                index = torch.from_numpy(rows)
                selected = tensor.index_select(0, index)
                out.append((tensor_name, selected))
                writes.append((tensor, index, selected))
            # an empty union: the table is equal on every member, nothing to send
        return out, writes, gathered_bytes, unions

    def averaged(self, unions, action):
        """After ``action``'s average over ``unions`` (:meth:`rows_to_average`), its rows written back: every
        member adopts the unions, a global average empties the sets (:meth:`hvd_dssync.sparse.RowSets.averaged`)."""
        self.row_sets.averaged(unions, action.kind == GLOBAL)

    def state(self):
        """For the checkpoint: None while there are no sets (every rank's model is the same), else this rank's
        rows that may differ."""
        if self.row_sets is None:
            return None
        return {name: torch.from_numpy(rows) for name, rows in self.row_sets.state_dict().items()}

    def load(self, rows):
        """Rows saved by :meth:`state`; a checkpoint without sets (``{}``: sparse averaging off when it was
        saved) means every row may differ."""
        self._loaded = None if rows is None else {k: torch.as_tensor(v).numpy() for k, v in rows.items()}
        if self.tables is not None:
            self._start()


def _gradient_rows(p):
    return p.grad.coalesce().indices()[0].numpy() if p.grad is not None and p.grad.is_sparse else None
