"""hvd_dssync.scope without Horovod: the scope's arithmetic, scope_of on a stand-in, the groups to register."""
import types

import pytest

from hvd_dssync.process_sets import ELASTIC_ENV
from hvd_dssync.scope import Scope, process_set_groups, scope_of


def fake_hvd(rank, size):
    """What scope_of reads of a Horovod module: rank(), size() and the global process set."""
    return types.SimpleNamespace(rank=lambda: rank, size=lambda: size,
                                 global_process_set=types.SimpleNamespace(process_set_id=0, ranks=list(range(size))))


def process_set(ranks, process_set_id=1):
    return types.SimpleNamespace(process_set_id=process_set_id, ranks=list(ranks))


def test_scope_maps_positions_to_global_ranks():
    scope = Scope(ranks=(2, 5, 7), rank=1)
    assert scope.world_size == 3
    assert scope.to_global((0, 2)) == (2, 7)
    assert scope.root() == 2 and scope.root(7) == 7
    with pytest.raises(ValueError, match="``root_rank`` \\(3\\) must be a rank of the process set"):
        scope.root(3)


def test_scope_of_the_global_set_is_the_whole_job():
    hvd = fake_hvd(rank=2, size=4)
    assert scope_of(hvd, hvd.global_process_set) == Scope((0, 1, 2, 3), 2)
    assert scope_of(hvd, process_set(range(4), process_set_id=0)) == Scope((0, 1, 2, 3), 2)  # by its id


def test_scope_of_a_process_set_is_its_sorted_ranks(monkeypatch):
    monkeypatch.delenv(ELASTIC_ENV, raising=False)
    assert scope_of(fake_hvd(rank=5, size=8), process_set([7, 5, 2])) == Scope((2, 5, 7), 1)


def test_scope_of_refuses_what_is_no_registered_set(monkeypatch):
    hvd = fake_hvd(rank=0, size=4)
    with pytest.raises(TypeError, match="``process_set`` must be a Horovod ProcessSet"):
        scope_of(hvd, [0, 1])
    with pytest.raises(ValueError, match="is not registered with Horovod"):
        scope_of(hvd, process_set([0, 1], process_set_id=None))
    monkeypatch.setenv(ELASTIC_ENV, "1")
    with pytest.raises(ValueError, match="not supported under elastic Horovod"):
        scope_of(hvd, process_set([0, 1]))


def test_process_set_groups_are_global_ranks_without_singletons_or_the_whole_set():
    assert process_set_groups([4, 5, 6, 7], schedule="butterfly") == ((4, 5), (4, 6), (5, 7), (6, 7))
    assert process_set_groups([3, 1], num_groups=1) == ()  # one group: the set itself
    groups = process_set_groups(range(8, 16), group_size=4, seed=3)
    assert all(len(g) == 4 and set(g) <= set(range(8, 16)) for g in groups)
    # the defaults are an optimizer's: "shuffle" with default_group_size (pairs for 4 ranks)
    assert all(len(g) == 2 for g in process_set_groups([0, 1, 2, 3]))


def test_process_set_groups_refuse_windows_and_racks():
    with pytest.raises(ValueError, match="changes its groups every 4 steps"):
        process_set_groups(range(4), num_groups=2, schedule_options={"window_steps": 4})
    with pytest.raises(ValueError, match="``group_size`` does not apply to schedule='topology'"):
        process_set_groups(range(4), group_size=2, schedule="topology")
