"""The adapters' parts alone, in one process: each is built from what it needs and returns what it did.

The multi-rank jobs (test_torch.py, test_keras.py) check them inside the optimizers; these check that a part
works without an optimizer around it, as the next engineer will want to when changing one.
"""
import os

import numpy as np
import pytest

from hvd_dssync.config import SyncConfig
from hvd_dssync.join import JoinState
from hvd_dssync.plan import GLOBAL, GROUP, LOCAL, Action, SyncPlan
from hvd_dssync.scope import Scope
from hvd_dssync.world import Done, World

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Importing an adapter sets HOROVOD_DYNAMIC_PROCESS_SETS for a later hvd.init(); the multi-rank jobs
    that run after these tests inherit this process's environment, so it is put back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _world(plan, process_set=None):
    scope = Scope(tuple(range(plan.world_size)), plan.rank)
    return World(plan, scope, process_set, JoinState(plan.world_size), in_process_set=False)


def test_torch_averaging_returns_what_it_did_and_keeps_its_state_for_the_checkpoint():
    from hvd_dssync.torch.averaging import Averaging
    from hvd_dssync.torch.checkpoint import dssync_state, load_dssync_state
    from hvd_dssync.torch.sparse_rows import SparseRows

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    sparse = SparseRows(optimizer, named, "dssync.0", enabled=False)
    averaging = Averaging(optimizer, named, "dssync.0", registry=None, guard=None, sparse=sparse, adaptive=None,
                          model=model, average_buffers=True, overlap=False, compression=None, outer_momentum=0.5)
    config = SyncConfig(num_groups=2, seed=0, average_every=2)
    plan = SyncPlan.from_config(0, 4, config)
    world = _world(plan)
    local = plan.action(0)
    assert local.kind == LOCAL
    assert averaging.average_model(world, local, 0) == Done(local)  # a local step: no op, nothing sent
    assert [name for name, _ in averaging.tensors()] == ["weight", "bias"]
    model.bias.requires_grad_(False)  # frozen: never averaged
    assert [name for name, _ in averaging.tensors()] == ["weight"]

    averaging._outer_step()  # the first average only sets the outer step's anchors
    state = dssync_state(7, plan, config, averaging, sparse)
    assert state["sync_step"] == 7 and "outer" in state
    fresh = Averaging(optimizer, named, "dssync.0", None, None, sparse, None, model, True, False, None, 0.5)
    assert load_dssync_state(state, plan, config, fresh, sparse) == 7
    assert fresh.outer.state() is not None
    other = SyncPlan.from_config(0, 4, SyncConfig(num_groups=1, seed=0, average_every=2))
    with pytest.raises(ValueError, match="configuration .* differs"):
        load_dssync_state(state, other, config, fresh, sparse)
    # Racks measured when saved and when resumed are the network's of the day (hvd_dssync.resense): either
    # schedule may stand, and the other's bridge carry means nothing.
    measured = {"how": "measured"}
    state = dssync_state(7, plan, config, averaging, sparse, measured)
    assert load_dssync_state(state, other, config, fresh, sparse, measured) == 7
    with pytest.raises(ValueError, match="configuration .* differs"):
        load_dssync_state(state, other, config, fresh, sparse, {"how": "hosts"})


def test_torch_sparse_rows_read_the_optimizer_they_are_given():
    from hvd_dssync.torch.sparse_rows import SparseRows

    table = torch.nn.Embedding(10, 2, sparse=True)
    table(torch.tensor([1, 4])).sum().backward()
    plain = SparseRows(torch.optim.SGD(table.parameters(), lr=0.1), table.named_parameters(), "n", True)
    assert sorted(plain.changed_rows(table.weight).tolist()) == [1, 4]
    adam = SparseRows(torch.optim.Adam(table.parameters()), table.named_parameters(), "n", True)
    assert adam.changed_rows(table.weight) is None  # Adam moves rows outside its gradient's


def test_torch_live_optimizers_in_the_order_a_training_iteration_steps_them():
    from hvd_dssync.torch import live

    a, b = _Optimizer(), _Optimizer()
    for optimizer in (a, b):
        live.live_optimizers.add(optimizer)
        live.note_construction(optimizer)
    try:
        assert live.in_training()[-2:] == [a, b]  # nothing stepped: construction order
        for _ in range(2):  # an iteration steps b, then a
            live.note_step(b)
            live.note_step(a)
        assert live.in_training() == [b, a]
    finally:
        live.live_optimizers.discard(a)
        live.live_optimizers.discard(b)


class _Optimizer:
    """Stands for an optimizer: live.py keeps weak references to it."""


def test_keras_switch_branches_sizes_and_bridges():
    pytest.importorskip("tensorflow")
    from hvd_dssync.keras.switch import FIRST_GROUP_BRANCH, GLOBAL_BRANCH, KEEP_BRANCH, Switch

    plan = SyncPlan(rank=0, world_size=4, schedule="topology", topology=[[0, 1], [2, 3]])
    switch = Switch.of(plan, Scope((0, 1, 2, 3), 0), process_set="global", registry=None)
    assert switch.branch_of(Action(LOCAL, (0,))) == KEEP_BRANCH
    assert switch.branch_of(Action(GLOBAL, (0, 1, 2, 3))) == GLOBAL_BRANCH
    groups = switch.groups
    assert groups and all(0 in g for g in groups)
    assert switch.branch_of(Action(GROUP, groups[-1])) == FIRST_GROUP_BRANCH + len(groups) - 1
    assert switch.sizes() == [1, 4] + [len(g) for g in groups]
    assert switch.global_groups()[GLOBAL_BRANCH] == (0, 1, 2, 3)
    if switch.bridges is not None:
        crossing, scales, carries, adds = switch.bridges
        assert len(crossing) == FIRST_GROUP_BRANCH + len(groups) and adds[KEEP_BRANCH] == 0.0
    assert np.all([switch.branch_of(plan.action(s)) >= 0 for s in range(8)])
