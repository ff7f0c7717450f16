"""The Keras adapter in real multi-rank jobs, under both launchers and several world sizes."""
import json
import os

import pytest

from multirank import LAUNCHERS, ROOT, matrix, run

pytestmark = pytest.mark.multirank


# 4 ranks in make test-wide only, for CI's time: 2 and 3 ranks give groups of several sizes under both launchers.
@pytest.mark.parametrize("launcher,np", matrix(wide=(4,)))
def test_semantics(launcher, np):
    """Exact group means step by step inside one traced fit; policies; callbacks; custom loop; drop-in."""
    output = run(launcher, np, "keras_semantics.py", timeout=420)
    assert output.count("all checks passed") == np, output


@pytest.mark.parametrize("launcher,np", matrix(wide=(4,)))
def test_saving(launcher, np):
    """h5, SavedModel and .keras round-trips; the loaded optimizer continues the schedule."""
    output = run(launcher, np, "keras_saving.py", timeout=300)
    assert output.count("all checks passed") == np, output


@pytest.mark.parametrize("launcher,np", matrix(wide=(4,)))
def test_digits_matches_horovod(launcher, np, tmp_path):
    """The example's comparison: DS-Sync within 1 percentage point of Horovod's Keras optimizer."""
    result = tmp_path / "digits.json"
    run(launcher, np, os.path.join(ROOT, "examples", "keras_digits.py"), "--quiet", "--json", result,
        timeout=420)
    accuracy = {name: r["final_accuracy"] for name, r in json.loads(result.read_text()).items()}
    assert accuracy["horovod"] > 0.9, accuracy
    assert accuracy["dssync"] >= accuracy["horovod"] - 0.01, accuracy


@pytest.mark.parametrize("launcher", [LAUNCHERS[0], pytest.param(LAUNCHERS[1], marks=pytest.mark.wide)])
def test_script_may_end_without_a_global_collective(launcher):
    """The exit-time drain lets a slower pair finish its last averages before the faster pair's exit shuts
    Horovod down (without it the slower pair's step fails)."""
    output = run(launcher, 4, "keras_exit.py", timeout=150)
    assert output.count("done") == 4, output


def test_sparse_embedding_averaging_equals_dense():
    """Embedding tables averaged by their rows give the dense average's models step by step, through a warm-up,
    global averages and a per-rank resume, with far fewer bytes; Adagrad and the legacy SGD's lazy momentum
    too; Adam densely with a warning; ranks that start apart start from full row sets."""
    output = run("gloo", 4, "keras_sparse.py", timeout=300)
    assert output.count("all checks passed") == 4, output


def test_a_stale_average_is_folded_in_exactly():
    """overlap=True in traced steps: averages run on a thread behind the local steps and are folded in at the next
    average (shuffle; racks with exact bridges, checked against the reference of overlapped averaging), and after
    synchronize_models every rank holds the mean of what the ranks computed; SynchronizeModelsCallback folds in the
    average in flight before an evaluation on one rank; compression and the adaptive policy are refused with
    overlap."""
    output = run("mpi", 4, "keras_overlap.py", timeout=180)
    assert output.count("all checks passed") == 4, output


def test_process_sets_and_fp16_compression():
    """Two process sets train side by side in traced steps (exact group means); bad sets refused; fp16 keeps
    updates below its resolution, within its error bound of the exact group means. One SyncConfig registers
    the groups and builds the optimizers (``sync=``)."""
    # The ranks outside a set never build its optimizer there: its ranks' agreement gives up after 5 s.
    output = run("gloo", 4, "keras_process_sets.py", timeout=420, env={"HVD_DSSYNC_AGREE_SECONDS": "5"})
    assert output.count("all checks passed") == 4, output


@pytest.mark.parametrize("launcher,np", [pytest.param("gloo", 3, id="gloo-np3"),
                                         pytest.param("mpi", 4, id="mpi-np4", marks=pytest.mark.wide)])
def test_horovod_fidelity(launcher, np):
    """Horovod's resume recipe, mixed precision with one rank overflowing (both wrapping orders), a rank a
    step behind stopped with the steps named, Horovod's optimizer attributes."""
    output = run(launcher, np, "keras_fidelity.py", timeout=420)
    assert output.count("all checks passed") == np, output
    assert output.count("ranks are at different DS-Sync steps") >= 2 * np, output


@pytest.mark.parametrize("launcher,np", matrix(sizes=(2,)))
def test_register_local_var_as_horovod(launcher, np):
    """Horovod's gradient-aggregation test with local variables, step by step: local variables neither
    allreduced nor averaged, their gradients divided by the set's size; backward passes summed or averaged."""
    output = run(launcher, np, "keras_local_vars.py", timeout=240)
    assert output.count("all checks passed") == np, output


# 8 and 16 ranks in make test-wide only: the PyTorch adapter's test registers a set's groups at 8 ranks in
# make test, through the same helper (hvd_dssync.scope).
WIDE = [pytest.param(launcher, np, id=f"{launcher}-np{np}", marks=pytest.mark.wide)
        for np in (8, 16) for launcher in LAUNCHERS]


@pytest.mark.parametrize("launcher,np", [*matrix(sizes=(2, 4)), *WIDE])
def test_ranks_outside_the_process_set(launcher, np):
    """Every rank builds the optimizer of the even ranks' set: the same errors everywhere; the even ranks train
    together, the odd ones alone with model.fit, sending nothing (passes and local scaling as Horovod's); at 8
    ranks and more the set's groups are registered by every rank together."""
    output = run(launcher, np, "keras_outside_set.py", timeout=300)
    assert output.count("all checks passed") == np, output
