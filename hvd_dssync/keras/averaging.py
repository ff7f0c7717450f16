"""Averaging for the Keras adapter: the model inside a step's group, the gradients during the warm-up.

A step's average is one grouped allreduce of the averaged variables on the Horovod process set of the
step's group, picked in the graph by ``tf.switch_case``, with the step guard's signature riding along.
Around it: exact bridges (a bridge rank's move carried into its rack's next average), the embedding tables
averaged by their rows (:mod:`.sparse_rows`) and the reference for lossy compression.
"""
import horovod.tensorflow as hvd
import tensorflow as tf

from ..differences import compress_difference, mix_difference
from .overlap import OverlappedAveraging
from .switch import GLOBAL_BRANCH, KEEP_BRANCH

__all__ = ["Averaging", "ExactAverage"]


class ExactAverage:
    """The exact average of tensors over a process set: one grouped allreduce, named by the step's op names
    (``name``), the kind of average and the set, with Horovod's ``compression`` and ``device_dense``.

    Example::

        average = ExactAverage("DSSyncSGD_0", hvd.Compression.none, "")
        *averaged, means = average(values + [bits], process_set, "group")
    """

    def __init__(self, name, compression=hvd.Compression.none, device_dense=""):
        self.name, self.compression, self.device_dense = name, compression, device_dense

    def __call__(self, values, process_set, kind):
        return hvd.grouped_allreduce(values, op=hvd.Average, compression=self.compression,
                                     process_set=process_set, device_dense=self.device_dense,
                                     ignore_name_scope=True, name=f"{self.name}_{kind}_{process_set.process_set_id}")


class Averaging:
    """How a traced step's variables and warm-up gradients are averaged.

    It is given Horovod's settings (``op``, ``compression``, ``gradient_predivide_factor``, ``sparse_as_dense``,
    ``device_dense``), the optimizer's ``process_set``, the step guard, the sparse rows and the exact average
    the branches share; each call gets the step's :class:`.switch.Switch` (the plan it was traced for, the
    groups and their process sets) and ``check``, the ops that must run first (the world check).

    Example::

        averaging = Averaging(horovod_settings, process_set, guard, sparse, exact_average)
        grads = averaging.gradients(switch, grads, step, check)             # before the local update
        averaging.average(switch, variables, step, branch, check)          # after it
    """

    def __init__(self, settings, process_set, guard, sparse, average, flight=None, choice=None,
                 fragments_at=lambda step: 1):
        # Horovod's arguments: op, compression, gradient_predivide_factor, sparse_as_dense, device_dense.
        self.op = settings["op"]
        self.compression = settings["compression"]
        self.gradient_predivide_factor = settings["gradient_predivide_factor"]
        self.sparse_as_dense = settings["sparse_as_dense"]
        self.device_dense = settings["device_dense"]
        self.process_set = process_set
        self.guard = guard
        self.sparse = sparse
        self.exact_average = average
        self.name = average.name
        # Lossy compression's shared reference per variable, and whether it was set (see _average_differences).
        self._references, self._reference_set = {}, None
        # Per variable, for exact bridges: what one left to add to the next group average, and the model the
        # last average left (what a bridge sends).
        self._carries, self._agreed = {}, {}
        # overlap=True: the averages go through ``flight`` (an .overlap.InFlight), folded in late; a global one in
        # fragments_at(step) fragments.
        self.overlapped = None if flight is None else OverlappedAveraging(
            guard, flight, self.kept, self.bridge, fragments_at, None if choice is None else choice.note_fold)
        # The default's trial (an .overlap_choice.OverlapChoice): each step's way read from its variable.
        self.choice = choice

    def forget_reference(self):
        """After a change of world: the next average after the warm-up sets the reference again."""
        if self._reference_set is not None:
            self._reference_set.assign(False)

    def gradients(self, switch, grads, step, check):
        """``grads`` averaged over all ranks in a bulk-synchronous (warm-up) step, else unchanged.

        ``None`` entries stay ``None``; sparse gradients need ``sparse_as_dense`` during the warm-up.
        """
        plan, guard = switch.plan, self.guard
        if plan.policy.warmup_steps == 0 or plan.world_size == 1:
            return list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        with tf.control_dependencies(check):
            dense = [tf.identity(self._dense(grads[i])) for i in present]
        bits = guard.signature(step, dense[0].dtype)

        def allreduce():
            reduced = self._allreduce_dense(dense + [bits], "bsp")
            if self.op == hvd.Sum:
                reduced[-1] = reduced[-1] / plan.world_size
            return reduced

        bsp = tf.cast(step, tf.int64) < plan.policy.warmup_steps
        begun = guard.begin(switch, tf.where(bsp, GLOBAL_BRANCH, KEEP_BRANCH), step, "bsp")
        with tf.control_dependencies([begun]):
            dense = [tf.identity(g) for g in dense]
        *reduced, means = tf.cond(bsp, allreduce, lambda: [tf.identity(g) for g in dense] + [bits])
        with tf.control_dependencies(reduced + [means]):
            ended = guard.end(begun)
        with tf.control_dependencies([ended]):
            checked = guard.check(switch, means, step, plan.world_size)
        with tf.control_dependencies([checked]):
            reduced = [tf.identity(g) for g in reduced]
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        return out

    def allreduce_gradients(self, switch, grads, check):
        """``grads`` reduced over all ranks as in a warm-up step, at any step (``None`` entries stay ``None``)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        if switch.plan.world_size == 1 or not present:
            return list(grads)
        with tf.control_dependencies(check):
            dense = [tf.identity(self._dense(grads[i])) for i in present]
        out = list(grads)
        for i, g in zip(present, self._allreduce_dense(dense, "allreduce_grads")):
            out[i] = g
        return out

    def _dense(self, gradient):
        if isinstance(gradient, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError("sparse gradients need sparse_as_dense=True to be allreduced by hvd_dssync")
            return tf.convert_to_tensor(gradient)
        return gradient

    def _allreduce_dense(self, dense, kind):
        """Horovod's gradient allreduce over all ranks: ``op``, ``compression``, ``gradient_predivide_factor``."""
        prescale = postscale = 1.0
        if self.op == hvd.Average and self.gradient_predivide_factor != 1.0:
            prescale = 1.0 / self.gradient_predivide_factor
            postscale = self.gradient_predivide_factor
        return hvd.grouped_allreduce(dense, op=self.op, compression=self.compression,
                                     prescale_factor=prescale, postscale_factor=postscale,
                                     device_dense=self.device_dense, ignore_name_scope=True,
                                     name=f"{self.name}_{kind}", process_set=self.process_set)

    def average(self, switch, variables, step, branch, check):
        """Assign to ``variables`` their average inside this rank's group at ``step`` (a tensor), whose switch
        branch is ``branch`` (a tensor); an op."""
        variables = list(variables)
        by_rows = self.sparse.positions() if self.compression is hvd.Compression.none else {}
        if self.overlapped is not None and self.choice is None:
            return self.overlapped.average(switch, variables, step, branch, check)
        if self.choice is not None and by_rows:
            self.choice.rule_out()  # tables averaged by their rows are waited for
        elif self.choice is not None:
            # The trial: each step's way read from its variable. A waited average folds in first what an
            # overlapped one left in flight (where the trial turned overlap off); a global average's fragments go
            # on where only they are in flight.
            def waited():
                folded = self.overlapped.fold_in_flight(switch, variables, check)
                with tf.control_dependencies([folded]):
                    fragment = self.overlapped.send_next_fragment(variables, step, tf.not_equal(branch, KEEP_BRANCH))
                return tf.group(self._waited(switch, variables, step, branch, [fragment], by_rows))

            return tf.cond(self.choice.overlapped,
                           lambda: tf.group(self.overlapped.average(switch, variables, step, branch, check)), waited)
        return self._waited(switch, variables, step, branch, check, by_rows)

    def _waited(self, switch, variables, step, branch, check, by_rows):
        """:meth:`average`, the average waited for; ``by_rows``: the tables averaged by their rows."""
        guard, sparse = self.guard, self.sparse
        begun = guard.begin(switch, branch, step, "group")
        with tf.control_dependencies(check + [begun]):
            # Tables averaged by their rows are not read whole: a live read would make their row update copy
            # the whole table first (copy-on-write).
            values = [None if v.ref() in by_rows else tf.identity(v) for v in variables]
        bits = guard.signature(step, variables[0].dtype)
        writes = []  # (table, rows' indices, averaged rows) of the tables averaged by their rows
        # Tables averaged by their rows: the bridge averages plainly.
        bridged = switch.bridges is not None and not any(v.ref() in by_rows for v in variables)
        if bridged:
            own = values
            crossing, scales, factors, adds, carries, agreed = self.bridge(switch, variables, branch)
            # A crossing sends the model the last average left times its scale, any other branch the model plus
            # the carry waiting (group branches); the average's move is measured from what was sent, unscaled.
            base = [tf.where(crossing > 0, k, v) for k, v in zip(agreed, own)]
            values = [b * tf.cast(scales, b.dtype) + c * tf.cast(adds, b.dtype) for b, c in zip(base, carries)]
        if self.compression is not hvd.Compression.none:
            *averaged, means = self._average_differences(switch, variables, values, bits, branch, step)
        elif any(v.ref() in by_rows for v in variables):
            with tf.control_dependencies(check + [begun]):
                variables, averaged, writes, means = sparse.average(switch, variables, values, bits, branch)
        else:
            sent = values + [bits]
            branches = [lambda: [tf.identity(v) for v in sent]]
            for process_set, kind, _, _ in switch.branch_sets():
                branches.append(lambda ps=process_set, k=kind: self.exact_average(sent, ps, k))
            *averaged, means = tf.switch_case(branch, branches, name=f"{self.name}_switch")
        with tf.control_dependencies(averaged + [means] + [rows for _, _, rows in writes]):
            ended = guard.end(begun)
        sizes = tf.constant(switch.sizes(), tf.int32)
        with tf.control_dependencies([ended]):
            checked = guard.check(switch, means, step, tf.gather(sizes, branch))
        with tf.control_dependencies([checked]):
            carried = []
            if bridged:  # a crossing moves the model by what the average moved the agreed one
                keep = tf.equal(branch, KEEP_BRANCH)
                moves = [a - b for a, b in zip(averaged, base)]
                averaged = [tf.where(crossing > 0, o + m, a) for o, m, a in zip(own, moves, averaged)]
                carried = [c.assign(tf.where(keep, c, tf.cast(factors, m.dtype) * m)) for c, m in zip(carries, moves)]
                carried += [k.assign(tf.where(keep, k, a)) for k, a in zip(agreed, averaged)]
            return tf.group(*[v.assign(a) for v, a in zip(variables, averaged)], *carried,
                            *[table.scatter_update(tf.IndexedSlices(rows, index)) for table, index, rows in writes])

    def bridge(self, switch, variables, branch):
        """This rank's exact bridge at ``branch`` (``switch.bridges`` is not None): the tables' entries
        ``(crossing, scales, carry factors, adds)`` as tensors, then the carries waiting and the models the last
        average left, a variable per one of ``variables`` (waited and overlapped averages share them)."""
        crossing, scales, factors, adds = (tf.gather(tf.constant(t), branch) for t in switch.bridges)
        carries = [self.kept(self._carries, v, "dssync_bridge_carry") for v in variables]
        agreed = [self.kept(self._agreed, v, "dssync_bridge_agreed", copy=True) for v in variables]
        return crossing, scales, factors, adds, carries, agreed

    @staticmethod
    def kept(store, variable, name, copy=False):
        """``store``'s variable for ``variable`` (a reference, a carry, the model the last average left), made on
        first use outside any traced function: zeros, or with ``copy`` the variable's value then."""
        key = variable.ref()
        if key not in store:
            with tf.init_scope():
                start = variable.read_value() if copy else tf.zeros(variable.shape, variable.dtype)
                store[key] = tf.Variable(start, trainable=False, name=name)
        return store[key]

    def _reference_of(self, variable):
        if self._reference_set is None:
            with tf.init_scope():
                self._reference_set = tf.Variable(False, trainable=False, name="dssync_reference_set")
        return self.kept(self._references, variable, "dssync_reference")

    def _average_differences(self, switch, variables, values, bits, branch, step):
        """Lossy compression: the group's models averaged through compressed differences from a shared reference
        (:mod:`hvd_dssync.differences`: what each rank sends and keeps, and when the reference moves).

        ``r`` is set by an exact average over the scope at the first step after the warm-up (the same step on
        every rank, whatever its group) and moved by global averages only. The step ``bits`` ride along
        uncompressed; their means come last.
        """
        references = [self._reference_of(v) for v in variables]
        compression = self.compression

        def establish():
            *exact, means = hvd.grouped_allreduce(values + [bits], op=hvd.Average, process_set=self.process_set,
                                                  device_dense=self.device_dense, ignore_name_scope=True,
                                                  name=f"{self.name}_reference")
            with tf.control_dependencies([r.assign(e) for r, e in zip(references, exact)]
                                         + [self._reference_set.assign(True)]):
                return [tf.identity(e) for e in exact] + [tf.identity(means)]

        def through(process_set, kind, moves_reference):
            def mix():
                sent = [compress_difference(v, r, compression) for v, r in zip(values, references)]
                compressed = [c for _, c, _ in sent]
                # TF's grouped allreduce takes one dtype; 0 and 1 and their means are exact enough in any float.
                *averaged, means = hvd.grouped_allreduce(compressed + [tf.cast(bits, compressed[0].dtype)],
                                                         op=hvd.Average,
                                                         process_set=process_set, device_dense=self.device_dense,
                                                         ignore_name_scope=True,
                                                         name=f"{self.name}_{kind}_{process_set.process_set_id}")
                means = tf.cast(means, bits.dtype)
                kept = [mix_difference(r, a, *rest, compression) for r, a, rest in zip(references, averaged, sent)]
                mixed, received = [m for m, _ in kept], [a for _, a in kept]
                if not moves_reference:
                    return mixed + [means]
                with tf.control_dependencies(mixed):
                    moved = [r.assign_add(a) for r, a in zip(references, received)]
                with tf.control_dependencies(moved):
                    return [tf.identity(m) for m in mixed] + [tf.identity(means)]
            return mix

        branches = [lambda: [tf.identity(v) for v in values] + [tf.identity(bits)]]
        branches += [through(process_set, kind, is_global) for process_set, kind, _, is_global in switch.branch_sets()]
        first = tf.logical_and(tf.logical_not(self._reference_set),
                               tf.cast(step, tf.int64) >= switch.plan.policy.warmup_steps)
        return tf.cond(first, establish, lambda: tf.switch_case(branch, branches, name=f"{self.name}_switch"))
