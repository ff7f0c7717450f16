"""The schedule's groups as Horovod process sets, for both adapters.

``hvd.add_process_set`` and ``hvd.remove_process_set`` are collectives over all ranks and must run in the
same order everywhere; every set a rank belongs to also negotiates on every Horovod cycle, so only the
groups of the running window stay registered. The registry keeps one Horovod process set per distinct
group with a reference count (two optimizers may share groups), registers in sorted order, and maps the
group of all ranks to ``global_process_set``. Sets registered statically by ``hvd.init(process_sets=...)``
are found and reused, never removed.

A re-initialized Horovod (an elastic reset: ``shutdown()`` then ``init()`` in a new world) has dropped
every dynamic set; :meth:`ProcessSetRegistry.refresh` notices it without communicating and forgets them,
and its ``generation`` tells each user of the registry that its groups must be acquired again.

Where the build can (patch level 9, docs/build.md), the registry marks each set it acquires *ordered*:
every member issues the set's allreduces in the same order (DS-Sync's groups do, by construction), so
Horovod sends each straight to the set's executor instead of negotiating it in its loop first
(:func:`mark_ordered`). A set used for other ops as well (sparse averaging gathers rows on it) is left
negotiated: ``acquire(groups, ordered=False)``. ``HVD_DSSYNC_ORDERED_SETS=0`` (on every rank alike) leaves
every set negotiated.

A changed network's groups can be registered *ahead*, by a thread of the process while training goes on
in the groups in force (:meth:`ProcessSetRegistry.register_ahead`): the sets are Horovod's as soon as that
thread is done, and the step that follows the new groups takes them up without a collective. Every
registration and removal of the registry waits for that thread first, so every rank adds its sets in the
same order.

It is framework-free: it is given the framework's Horovod module (``horovod.torch`` or
``horovod.tensorflow``), whose process-set functions both come from ``horovod.common``.
"""
import os
import threading
import time

__all__ = ["ProcessSetRegistry", "registry_for", "DYNAMIC_ENV", "ORDERED_ENV", "enable_dynamic_process_sets",
           "use_static_process_sets", "elastic_job", "ordered_sets_enabled", "mark_ordered",
           "horovod_library"]

DYNAMIC_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"
ORDERED_ENV = "HVD_DSSYNC_ORDERED_SETS"  # "0": every set negotiated, as on a build without patch level 9
ELASTIC_ENV = "HOROVOD_ELASTIC"

_registries = {}
_dynamic_set_by_us = []


def enable_dynamic_process_sets():
    """Let a later plain ``hvd.init()`` add process sets: Horovod reads this variable at init."""
    if DYNAMIC_ENV not in os.environ:
        os.environ[DYNAMIC_ENV] = "1"
        _dynamic_set_by_us.append(True)


def use_static_process_sets():
    """Undo :func:`enable_dynamic_process_sets` before an ``hvd.init`` given every set up front.

    Dynamic mode costs a global exchange on every Horovod cycle; a job whose sets are all registered at
    init does not need it. A value the user set is left alone. Returns whether dynamic mode stays on.
    """
    if _dynamic_set_by_us and os.environ.get(DYNAMIC_ENV) == "1":
        del os.environ[DYNAMIC_ENV]
        _dynamic_set_by_us.clear()
    return os.environ.get(DYNAMIC_ENV, "0") not in ("0", "")


def elastic_job():
    """Whether this process is a worker of an elastic Horovod job (horovodrun sets the variable).

    There a joining worker builds its optimizer while the others sync state, so the adapters defer their
    construction-time collectives.
    """
    return os.environ.get(ELASTIC_ENV) == "1"


def _horovod_table():
    """Horovod's process-set table, ``{id: ranks}``, as this process sees it; no communication."""
    from horovod.common import process_sets as common

    return common._basics._get_process_set_ids_and_ranks()


def _table_size():
    """How many sets Horovod's table holds on this rank, those added and not yet agreed on included."""
    from horovod.common import process_sets as common

    return int(common._basics.MPI_LIB_CTYPES.horovod_number_of_process_sets())


def ordered_sets_enabled(environ=None):
    """Whether DS-Sync marks its sets ordered where the build can (:data:`ORDERED_ENV` not "0").

    Example::

        >>> ordered_sets_enabled({}), ordered_sets_enabled({"HVD_DSSYNC_ORDERED_SETS": "0"})
        (True, False)
    """
    environ = os.environ if environ is None else environ
    return environ.get(ORDERED_ENV, "1") not in ("0", "")


def horovod_library():
    """Horovod's loaded common library (the framework's ``mpi_lib``, through ctypes), or None where no framework
    has loaded it: where the build's C functions are looked up (:func:`mark_ordered`,
    :mod:`hvd_dssync.horovod_loop`)."""
    from horovod.common import process_sets as common

    return getattr(getattr(common, "_basics", None), "MPI_LIB_CTYPES", None)


def mark_ordered(process_set, ordered=True):
    """Mark Horovod's ``process_set`` ordered (or not): its CPU allreduces skip the negotiation and run on the
    set's executor as issued, each checked first against the other members' (a header of names, dtypes and
    shapes compared in one small allreduce: members that issued different ops all get the same error).
    Every member must mark a set alike before its first op on it. Returns whether the set is now ordered:
    False on a build without patch level 9, for the global set, on a rank outside the set, or where Horovod
    runs the set's ops in its loop (``HOROVOD_PROCESS_SETS_ASYNC=0``, or ``HOROVOD_ORDERED_PROCESS_SETS=0``).

    Example::

        mark_ordered(hvd.add_process_set([0, 1]))   # True on the project's build, on ranks 0 and 1
    """
    set_ordered = getattr(horovod_library(), "horovod_process_set_set_ordered", None)
    if set_ordered is None:
        return False
    return set_ordered(int(process_set.process_set_id), int(bool(ordered))) == 1


def registry_for(hvd):
    """The process's one registry for the Horovod module ``hvd``.

    Horovod's process-set functions live in ``horovod.common`` for every framework, so ``horovod.torch``,
    ``horovod.tensorflow`` and ``horovod.tensorflow.keras`` share one registry, as they share the sets.
    """
    key = getattr(hvd.add_process_set, "__module__", hvd.__name__)
    if key not in _registries:
        _registries[key] = ProcessSetRegistry(hvd)
    return _registries[key]


class _Ahead:
    """Sets being registered on a thread (:meth:`ProcessSetRegistry.register_ahead`): ``add()`` returns
    ``{group: process set}``. What failed there is kept in ``error``, for the training thread to raise."""

    def __init__(self, add):
        self.sets = {}
        self.error = None
        self._thread = threading.Thread(target=self._register, args=(add,), name="hvd_dssync.register_ahead",
                                        daemon=True)
        self._thread.start()

    def _register(self, add):
        try:
            self.sets = add()
        except BaseException as error:
            self.error = error

    def done(self):
        return not self._thread.is_alive()

    def wait(self):
        self._thread.join()
        return self.sets


class ProcessSetRegistry:
    """Reference-counted process sets, one per distinct group of ranks."""

    def __init__(self, hvd):
        self.hvd = hvd
        self._sets = {}
        self._counts = {}
        self._static = set()
        self._ordered = {}  # group: whether its set is marked ordered (a set used otherwise stays unmarked)
        self._identity = None
        self.generation = 0
        self._ahead = None  # the thread registering sets ahead, and what it registered

    def reset(self):
        """Forget every set (after ``hvd.shutdown()`` or an elastic reset, which drop them all)."""
        self._ahead = None
        self._sets.clear()
        self._counts.clear()
        self._static.clear()
        self._ordered.clear()
        self._identity = None
        self.generation += 1

    def refresh(self):
        """Forget every set if Horovod was re-initialized since; return ``generation``. No communication.

        Horovod was re-initialized when this rank's rank or the world size changed, or when a registered
        set is no longer in Horovod's table with the same ranks (``shutdown()`` drops them all).
        """
        identity = (self.hvd.size(), self.hvd.rank())
        stale = self._identity is not None and identity != self._identity
        # While sets are registered ahead, Horovod's table holds sets not agreed on yet, which it cannot list:
        # the check waits for the next step (an elastic reset, what it looks for, registers nothing ahead).
        if not stale and self._sets and self.ahead_done():
            table = _horovod_table()
            stale = any(table.get(ps.process_set_id) != list(g) for g, ps in self._sets.items())
        if stale:
            self.reset()
        self._identity = identity
        return self.generation

    def _world(self):
        return tuple(range(self.hvd.size()))

    def registered(self, groups):
        """``{group: process set}`` for those of ``groups`` Horovod has a set of (registered by anyone, at init
        or later); no communication. Waits for sets being registered ahead (Horovod cannot list them before)."""
        self._settle_ahead()
        found = self._find_static()
        return {g: self._sets.get(g, found.get(g)) for g in map(tuple, groups) if g in self._sets or g in found}

    def _find_static(self):
        from horovod.common import process_sets as common

        found = {}
        for set_id, ranks in _horovod_table().items():
            if set_id != 0:
                ps = common._temp_process_set_object(set_id)
                ps.ranks = list(ranks)
                found[tuple(ranks)] = ps
        return found

    def register_ahead(self, groups):
        """Start registering the sets of ``groups`` that are not registered yet, in sorted order, on a thread
        of this process (a collective: call on all ranks at the same point); training goes on meanwhile.
        :meth:`ahead_done` tells when they are Horovod's; :meth:`acquire` then takes them up without
        communicating (and marks them ordered, as any set it registers). Returns the groups it registers.

        Example::

            registry.register_ahead([(0, 1, 2, 3), (4, 5, 6, 7)])   # while the old groups still average
            ...
            if every_rank_done:                                       # agreed on, e.g. in an allgather
                registry.acquire([(0, 1, 2, 3), (4, 5, 6, 7)])        # no collective: registered ahead
        """
        self._settle_ahead()
        groups = sorted({tuple(sorted(g)) for g in groups} - {self._world()} - set(self._sets)
                        - set(self._find_static()))
        self._ahead = _Ahead(lambda: self._add_all(groups))
        return groups

    def ahead_done(self):
        """Whether no sets are being registered ahead (:meth:`register_ahead`): none asked for, or all registered
        (or failed: :meth:`acquire` raises the error); no communication."""
        return self._ahead is None or self._ahead.done()

    def _settle_ahead(self):
        """Wait for the sets registered ahead and keep them (no reference yet); raise what failed there."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        for g, process_set in ahead.wait().items():
            self._sets[g] = process_set
            self._counts.setdefault(g, 0)
        if ahead.error is not None:
            raise ahead.error

    def release_unused(self):
        """Remove the sets registered ahead that nobody acquired (a collective)."""
        self._settle_ahead()
        for g in sorted(g for g, count in self._counts.items() if count == 0):
            self._remove(g)

    def _add_all(self, groups):
        """``{group: process set}``, each of ``groups`` added to Horovod in the order given, all in one agreement
        of its loop: each add blocks until every rank has added its set, so each runs on its own thread, started
        once the last one's set is in this rank's table (every rank gives its sets the same ids)."""
        sets, errors, threads = {}, [], []

        def add(group):
            try:
                sets[group] = self._add(group)
            except BaseException as error:
                errors.append(error)

        for group in groups:
            before = _table_size()
            thread = threading.Thread(target=add, args=(group,), name="hvd_dssync.add_process_set", daemon=True)
            thread.start()
            threads.append(thread)
            while thread.is_alive() and _table_size() == before:
                time.sleep(0.0005)
            if errors:
                break
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return sets

    def _add(self, group):
        try:
            return self.hvd.add_process_set(list(group))
        except ValueError as e:
            if DYNAMIC_ENV not in str(e):
                raise
            # Horovod refuses before communicating, so every rank raises this same error.
            raise RuntimeError(
                f"hvd_dssync needs a process set for group {group}, but Horovod was initialized without "
                "dynamic process sets. Import hvd_dssync.torch (or hvd_dssync.keras) before hvd.init(), "
                f"or call hvd_dssync's init(), or set {DYNAMIC_ENV}=1 in the environment of every rank."
            ) from None

    def acquire(self, groups, ordered=True):
        """Register every group not yet registered, in sorted order (a collective: call on all ranks), and
        mark each set ordered (:func:`mark_ordered`) unless ``ordered`` is False or a user of the set asked
        for it negotiated before (every rank acquires alike, so every member marks alike). Sets registered
        ahead are taken up first (:meth:`register_ahead`: this waits for them)."""
        self._settle_ahead()
        groups = sorted({tuple(sorted(g)) for g in groups} - {self._world()})
        missing = [g for g in groups if g not in self._sets]
        if missing:
            existing = self._find_static()
            for g in missing:
                if g in existing:
                    self._sets[g] = existing[g]
                    self._static.add(g)
            missing = [g for g in missing if g not in self._sets]
        self._sets.update(self._add_all(missing))
        for g in groups:
            self._counts[g] = self._counts.get(g, 0) + 1
            want = ordered and self._ordered.get(g, True) and ordered_sets_enabled()
            if self._ordered.get(g, False) != want:
                mark_ordered(self._sets[g], want)
            self._ordered[g] = want

    def release(self, groups):
        """Drop one reference to each group; remove the sets nobody uses (a collective)."""
        self._settle_ahead()
        groups = sorted({tuple(sorted(g)) for g in groups} - {self._world()})
        for g in groups:
            count = self._counts.get(g, 0) - 1
            if count > 0:
                self._counts[g] = count
                continue
            self._remove(g)

    def _remove(self, group):
        """Forget ``group``'s references and remove its set from Horovod unless registered at init (a collective)."""
        self._counts.pop(group, None)
        if group not in self._static and group in self._sets:
            self._ordered.pop(group, None)
            self.hvd.remove_process_set(self._sets.pop(group))

    def get(self, group):
        """The process set of ``group`` (must be acquired; the whole world is the global set)."""
        group = tuple(sorted(group))
        if group == self._world():
            return self.hvd.global_process_set
        try:
            return self._sets[group]
        except KeyError:
            raise KeyError(f"group {group} has no registered process set; acquire it first") from None

    def live_groups(self):
        return tuple(sorted(self._sets))
