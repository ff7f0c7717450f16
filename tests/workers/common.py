"""What the job workers of this folder share, free of any framework.

Workers run as ``python tests/workers/<script>.py``, so this folder is first on ``sys.path`` and
``import common`` finds this module. Horovod modules and framework ops come in as arguments; what needs
PyTorch or Keras stays in the workers (``torch_semantics.py`` and ``keras_semantics.py`` hold what several
workers of one framework share).

Every check raises ``AssertionError`` naming this process's rank, so a failing rank exits non-zero and fails
the launch. A worker that checks several behaviours runs each inside :func:`behaviour`, so that a failure
names the behaviour that broke (``tests/multirank.py`` puts it first in the failed job's message).
"""
import contextlib
import copy
import os
import socket
import sys

RANK = None  # this process's rank, named by every failed check; set by identify()


def identify(hvd):
    """This process's rank and the world's size from an initialized Horovod module (``horovod.torch`` or
    ``horovod.tensorflow.keras``); from now on a failed check names the rank."""
    global RANK
    RANK = hvd.rank()
    return RANK, hvd.size()


def init_with_dynamic_sets(hvd, size=None, job="the job"):
    """``hvd.init()`` with dynamic process sets (unless the environment says otherwise), then :func:`identify`;
    with ``size``, check that ``job`` runs on that many ranks. Returns this rank and the world's size."""
    os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    hvd.init()
    rank, world = identify(hvd)
    if size is not None:
        check(world == size, f"{job} runs on {size} ranks")
    return rank, world


def horovod_argument_warnings(build):
    """``build()``'s result and the ``hvd_dssync.HorovodArgumentWarning``s it gave (every warning recorded)."""
    import warnings

    from hvd_dssync import HorovodArgumentWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build()
    return result, [w for w in caught if issubclass(w.category, HorovodArgumentWarning)]


def launcher_rank(default="0"):
    """This process's rank as the launcher set it (horovodrun or mpirun), before Horovod is initialized."""
    return os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", default))


def launcher_size():
    """The world's size as the launcher set it (horovodrun or mpirun), before Horovod is initialized."""
    return int(os.environ.get("HOROVOD_SIZE") or os.environ["OMPI_COMM_WORLD_SIZE"])


BEHAVIOUR_FAILED = "BEHAVIOUR FAILED:"


@contextlib.contextmanager
def behaviour(name):
    """Run one behaviour's checks; if anything in it raises, print ``BEHAVIOUR FAILED: <name>`` first.

    Example::

        with behaviour("group means, shuffle"):
            check_group_means("shuffle", num_groups=2)
    """
    try:
        yield
    except BaseException as e:
        print(f"{BEHAVIOUR_FAILED} {name} (rank {RANK}): {type(e).__name__}: {str(e).splitlines()[0][:300]}",
              file=sys.stderr, flush=True)
        raise


def fail(message):
    raise AssertionError(f"rank {RANK}: {message}")


def check(condition, message):
    if not condition:
        fail(message)


def check_alike(everyone, message):
    """``everyone`` (one value per rank, as an allgather gives them): every rank's value is the same."""
    check(all(value == everyone[0] for value in everyone), message)


def check_consensus(rows, equal, distance, after):
    """After ``after`` (a synchronization): every rank's weights (``rows``, one a rank) are ``equal`` and the
    consensus distance is 0."""
    check(all(equal(rows[0], row) for row in rows), f"weights differ after {after}")
    check(distance == 0.0, f"consensus distance after {after} is {distance}, want 0")


def expect_error(kind, words, build):
    """``build()`` raises ``kind`` with every one of ``words`` in its message."""
    try:
        build()
    except kind as e:
        check(all(w in str(e) for w in words), f"error {e!r} lacks {words}")
        return
    fail(f"no {kind.__name__} mentioning {words}")


# What DS-Sync must do, computed on the side: scalar models, every rank starting at its own rank.

def check_idle_loop(horovod_loop):
    """After an optimizer was built, Horovod's loop on this rank waits its idle cycle (10 ms) between ops: at most
    150 cycles in a second with nothing to do, where at Horovod's own cycle (1 ms) it runs hundreds under Gloo
    (patch level 11; under MPI its cycles take about as long as an idle one, so only Gloo jobs check)."""
    if os.environ.get("HVD_DSSYNC_TEST_LAUNCHER") != "gloo":
        return
    import time

    before = horovod_loop.loop_cycles()
    check(before is not None, "Horovod was built without patch level 11 (an idle loop that sleeps)")
    time.sleep(1.0)
    cycles = horovod_loop.loop_cycles() - before
    check(cycles <= 150, f"Horovod's loop ran {cycles} cycles in 1 s idle after the optimizer was built")


def step_groups(plan, step, size):
    """The kind of ``plan``'s step and the groups of global ranks that average at it (none at a step without
    an average): a group step averages in the groups of the schedule's step ``plan.policy.schedule_step``."""
    kind = plan.action(step).kind
    if kind == "group":
        return kind, plan.schedule.groups(plan.policy.schedule_step(step))
    if kind == "global":
        return kind, [tuple(range(size))]
    return kind, []


def averaged(values, groups):
    """``values`` (a list or dict, one a rank) after every group of ``groups`` averaged: each member holds its
    group's mean."""
    new = copy.copy(values)
    for group in groups:
        mean = sum(values[r] for r in group) / len(group)
        for r in group:
            new[r] = mean
    return new


def expected_values(plan, size, steps, overlap=False, skipped=()):
    """Each rank's scalar value after each step, when every rank starts at its rank and lr is 0.

    With ``overlap`` an average lands one step late; ``skipped`` steps (a loss-scale optimizer's, on overflow)
    count but neither update nor average.
    """
    values, carries = [float(r) for r in range(size)], [0.0] * size
    history = []
    for t in range(steps):
        if not overlap or t > 0:
            step = t - 1 if overlap else t
            if step not in skipped:
                values, carries = averaged_step(plan, step, size, values, carries)
        history.append(values[:])
    return history


def averaged_step(plan, step, size, values, carries):
    """``(values, carries)`` after ``plan``'s averages at ``step``, exact bridges included: at a group step each
    rank sends its value plus what a bridge left it to carry, times its bridge's scale (``schedule.bridge``),
    and a bridge rank then carries ``carry`` times its move; a global or bulk-synchronous step drops the
    carries, a local step keeps them."""
    kind, groups = step_groups(plan, step, size)
    if kind == "local":
        return values, carries
    if kind != "group":
        return averaged(values, groups), [0.0] * size
    at = plan.policy.schedule_step(step)
    bridges = [plan.schedule.bridge(r, at) for r in range(size)]
    sent = [(values[r] + carries[r]) * (1.0 if b is None else b.scale) for r, b in enumerate(bridges)]
    new = averaged(sent, [g for g in groups if len(g) > 1])
    for r, b in enumerate(bridges):
        if all(len(g) == 1 for g in groups if r in g):
            new[r] = values[r]  # a rank alone keeps its model; the carry goes
    return new, [0.0 if b is None else (new[r] - values[r]) * b.carry for r, b in enumerate(bridges)]


# What both adapters' overlap jobs check (4 ranks): (behaviour, steps, optimizer arguments) of the stale fold's
# mean, and the racks-then-a-bridge-every-step arguments of the check against overlapped_reference.
STALE_FOLD_CASES = [
    ("a stale average is folded in exactly (shuffle, every 3 steps)", 23,
     dict(schedule="shuffle", num_groups=2, average_every=3)),
    ("a stale average is folded in exactly (racks, exact bridges, every 4 steps)", 29,
     dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=4)),
    # The default's rhythm on racks: an overlapped global average goes over every rank at once.
    ("a stale global average is folded in exactly (racks every 2 steps, every rank every 4)", 21,
     dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=2, global_every=4,
          schedule_options={"intra_steps": None, "global_via_bridges": "auto"})),
]
BRIDGE_EVERY_STEP = dict(schedule="topology", topology=[[0, 1], [2, 3]], average_every=1,
                         schedule_options={"intra_steps": 1})


def overlapped_reference(plan, size, steps, lr):
    """Every rank's weight after each of ``steps`` steps of overlapped DS-Sync averaging at every step, where
    rank r's gradient is the constant ``r + 1`` and SGD's rate ``lr`` (each average folded in at the next step,
    after its local update): a rank sends its model, or at an exact bridge the model its last average left,
    the same on every member of its rack (before any average, its model), and folds in ``average - sent``;
    what is averaged, with the bridges' scale and carry, as in :func:`averaged_step`. Returns that history
    and the weights once the last average is folded in too (a drain)."""
    values, agreed, carries, pending, history = [0.0] * size, [None] * size, [0.0] * size, None, []
    for t in range(steps):
        values = [v - lr * (r + 1) for r, v in enumerate(values)]
        if pending is not None:
            sent, got, bridges = pending
            values = [values[r] + got[r] - sent[r] for r in range(size)]
            agreed = [values[r] if b is not None else got[r] for r, b in enumerate(bridges)]
        bridges = [plan.schedule.bridge(r, plan.policy.schedule_step(t)) for r in range(size)]
        sent = [values[r] if b is None or agreed[r] is None else agreed[r] for r, b in enumerate(bridges)]
        got, carries = averaged_step(plan, t, size, sent, carries)
        pending = (sent, got, bridges)
        history.append(values)
    sent, got, _ = pending
    return history, [values[r] + got[r] - sent[r] for r in range(size)]


def simulate(ranks, schedule, policy, values, grads, lr, steps):
    """Exact DS-Sync with SGD inside the process set of ``ranks``: each member's value after each step.

    ``values`` and ``grads`` map each member to its start and its gradient; ``schedule`` names positions in
    ``ranks``; ``policy.action(t)`` is "bsp" (the gradients averaged), "global" or a group step.
    """
    values, history = dict(values), []
    for t in range(steps):
        kind = policy.action(t)
        if kind == "bsp":
            mean_grad = sum(grads[r] for r in ranks) / len(ranks)
            values = {r: values[r] - lr * mean_grad for r in ranks}
        else:
            values = {r: values[r] - lr * grads[r] for r in ranks}
            groups = [range(len(ranks))] if kind == "global" else schedule.groups(t)
            values = averaged(values, [[ranks[i] for i in group] for group in groups])
        history.append(dict(values))
    return history


# Jobs across emulated hosts of ``slots`` ranks each.

def check_host_layout(hvd, allgather_object, slots):
    """Horovod's layout: ranks numbered host by host, ``slots`` per host, every host its own hostname.
    Returns the layout and every rank's hostname."""
    size = hvd.size()
    layout = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    check(layout == (RANK % slots, slots, RANK // slots, size // slots), f"layout {layout}")
    hosts = allgather_object(socket.gethostname(), name="test.hosts")
    check(all((hosts[a] == hosts[b]) == (a // slots == b // slots) for a in range(size) for b in range(size)),
          f"hostnames {hosts}")
    return layout, hosts


def check_sensed_hosts(sensed, size, slots, racks=None):
    """The default sensed the racks: with ``racks`` (a count) it measured that many racks of consecutive
    hosts, else it took each host as a rack. Returns what it sensed (``{}`` for nothing)."""
    sensed = sensed or {}
    if racks is None:
        how, want = "hosts", [list(range(h * slots, (h + 1) * slots)) for h in range(size // slots)]
    else:
        how, want = "measured", [list(range(k * size // racks, (k + 1) * size // racks)) for k in range(racks)]
    check(sensed.get("how") == how and sensed.get("racks") == want, f"sensed {sensed}, want {how} {want}")
    return sensed


def crosses_hosts(groups, slots):
    return any(len({r // slots for r in g}) > 1 for g in groups)


# Jobs where every rank builds an optimizer restricted to the even ranks' process set.

def even_and_odd_sets(hvd):
    """The even and the odd ranks' process sets, added to Horovod, and the one of this rank."""
    size = hvd.size()
    even_set = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odd_set = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    return even_set, odd_set, even_set if RANK % 2 == 0 else odd_set


def check_outside_weights(everyone, weights, mine, even_set, close):
    """``everyone``: the weights of every rank of this rank's set (``mine``), in its order. The even ranks
    trained together: their models are equal; the odd ranks trained alone: theirs differ."""
    if mine is even_set:
        for other in everyone:
            check(close(other, weights), "even ranks ended with different models")
    else:
        for position, other in enumerate(everyone):
            if position != mine.rank():
                check(not close(other, weights), "odd ranks averaged although outside the optimizer's set")
