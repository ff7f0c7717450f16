"""The rules of sparse averaging (hvd_dssync.sparse), checked against dense averaging without communication."""
import numpy as np

from hvd_dssync.schedules import Shuffle
from hvd_dssync.sparse import RowSets, average_densely, pack_rows, unpack_unions


def test_unions_reproduce_dense_group_averages_over_shuffled_groups():
    """Eight simulated ranks touch power-law rows, average in shuffled groups of 2 and 4 and globally now
    and then: averaging only the unions gives the dense averages exactly, and the sets stay small."""
    ranks, rows, rng = 8, 500, np.random.default_rng(0)
    dense = np.tile(rng.normal(size=(1, rows)), (ranks, 1))
    sparse = dense.copy()
    sets = [RowSets({"t": rows}) for _ in range(ranks)]
    schedule = Shuffle(ranks, num_groups=2, seed=1)
    in_play = []
    for step in range(60):
        for r in range(ranks):
            touched = np.minimum(rng.zipf(1.5, size=5) - 1, rows - 1)
            update = rng.normal(size=len(touched))
            np.add.at(dense[r], touched, update)
            np.add.at(sparse[r], touched, update)
            sets[r].touch("t", touched)
        groups = [tuple(range(ranks))] if step % 10 == 9 else schedule.groups(step)
        for group in groups:
            dense[list(group)] = dense[list(group)].mean(axis=0)
            union = unpack_unions(np.concatenate([pack_rows(sets[r]) for r in group]), {"t": rows})["t"]
            sparse[np.ix_(group, union)] = sparse[np.ix_(group, union)].mean(axis=0)
            for r in group:
                sets[r].adopt("t", union)
        if len(groups) == 1:
            for s in sets:
                s.clear()
        in_play.append(max(s.total() for s in sets))
        np.testing.assert_allclose(sparse, dense, rtol=0, atol=1e-12, err_msg=f"step {step}")
    assert max(in_play) < rows / 2 and in_play[9] == 0


def test_packing_keeps_tables_apart_and_ranks_with_empty_sets_send_one_element():
    sets = RowSets({"a": 5, "b": 3})
    assert pack_rows(sets).tolist() == [-1]
    sets.touch("b", [2, 0])
    sets.touch("a", [4])
    unions = unpack_unions(np.concatenate([pack_rows(sets), [-1, 1]]), sets.tables)
    assert unions["a"].tolist() == [1, 4] and unions["b"].tolist() == [0, 2]


def test_checkpointed_sets_and_the_safe_start():
    sets = RowSets({"a": 4, "b": 6})
    sets.touch("a", [3])
    restored = RowSets({"a": 4, "b": 6})
    restored.load_state_dict({"a": sets.state_dict()["a"]})  # "b" missing: every row may differ
    assert restored.rows("a").tolist() == [3] and restored.size("b") == 6
    assert average_densely(4, 6) and not average_densely(3, 6)
