"""The PyTorch adapter in real multi-rank jobs, under both launchers and several world sizes."""
import json

import pytest

from multirank import LAUNCHERS, ROOT, matrix, run

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("launcher,np", matrix())
def test_semantics(launcher, np):
    """Group means step by step, schedule agreement, sync, drop-in arguments, policies, unnamed ops."""
    output = run(launcher, np, "torch_semantics.py", timeout=300)
    assert output.count("all checks passed") == np, output


@pytest.mark.parametrize("np", [pytest.param(2, marks=pytest.mark.wide), 4])
def test_init_from_mpi4py_communicator(np):
    output = run("mpi", np, "torch_semantics.py", "--init", "mpi4py", "--quick")
    assert output.count("all checks passed") == np, output


# One launcher each in make test (gloo here, mpi for the rotating bridges); both in make test-wide.
@pytest.mark.parametrize("launcher", [LAUNCHERS[0], pytest.param(LAUNCHERS[1], marks=pytest.mark.wide)])
def test_static_process_sets_from_dss_init(launcher):
    output = run(launcher, 4, "torch_semantics.py", "--init", "static")
    assert output.count("all checks passed") == 4, output


@pytest.mark.parametrize("launcher", [pytest.param(LAUNCHERS[0], marks=pytest.mark.wide), LAUNCHERS[1]])
def test_static_process_sets_for_rotating_bridges(launcher):
    """dss.init registers every window's groups of a topology schedule whose bridges rotate: no dynamic mode."""
    output = run(launcher, 4, "torch_semantics.py", "--init", "static-topology")
    assert output.count("all checks passed") == 4, output


def _train(launcher, optimizer, seed, tmp_path):
    out = tmp_path / f"{launcher}-{optimizer}-{seed}.json"
    run(launcher, 4, f"{ROOT}/examples/pytorch_digits.py", "--optimizer", optimizer, "--epochs", 15,
        "--seed", seed, "--quiet", "--json", out, timeout=300)
    return json.loads(out.read_text())["final_accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["gloo"])
def test_digits_accuracy_matches_horovod(launcher, tmp_path):
    """4 ranks, same epochs and hyper-parameters: DS-Sync within 1 point of hvd.DistributedOptimizer (under
    Gloo only, for the suite's time: the launcher changes no figure of the arithmetic)."""
    seeds = (0, 1)
    dssync = sum(_train(launcher, "dssync", s, tmp_path) for s in seeds) / len(seeds)
    horovod = sum(_train(launcher, "horovod", s, tmp_path) for s in seeds) / len(seeds)
    assert dssync >= horovod - 0.01, f"DS-Sync {dssync:.4f} vs Horovod {horovod:.4f} (mean over seeds {seeds})"
    assert dssync > 0.9, f"DS-Sync reached only {dssync:.4f} test accuracy"


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_script_may_end_without_a_global_collective(launcher):
    """The exit-time drain lets slower groups finish their last average before Horovod shuts down."""
    output = run(launcher, 4, "torch_exit.py", timeout=120)
    assert output.count("done") == 4, output


def test_a_stale_average_is_folded_in_exactly():
    """overlap=True with local steps (shuffle; racks with exact bridges; the default's rhythm on racks, its global
    averages overlapped too): averages run behind the local steps and are folded in late, and after
    synchronize_models every rank holds the mean of what the ranks computed; an exact bridge after an overlapped
    rack average sends the rack's average; evaluating the model on one rank folds in its average in flight;
    overlap=True beside global_via_bridges=True keeps the route, waited for; one host runs no trial of overlap."""
    output = run("gloo", 4, "torch_overlap.py", timeout=120)
    assert output.count("all checks passed") == 4, output


def test_without_the_drain_the_slower_group_fails_clearly():
    output = run("mpi", 4, "torch_exit.py", timeout=120, env={"HVD_DSSYNC_EXIT_TIMEOUT": "0"},
                 expect_failure=True)
    assert "hvd_dssync: Horovod is shut down" in output, output


@pytest.mark.parametrize("launcher,np", [pytest.param("gloo", 4, id="gloo-np4"), pytest.param("mpi", 3, id="mpi-np3")])
def test_scripts_written_for_horovod(launcher, np):
    """Horovod's resume recipe, GradScaler with one rank overflowing, what is averaged, overlapping optimizers,
    Horovod's warning and attributes; ranks drifting one step apart all raise an error naming their steps."""
    output = run(launcher, np, "torch_fidelity.py", timeout=240)
    assert output.count("all checks passed") == np, output


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_uneven_data_with_hvd_join(launcher):
    """Horovod's recipe for uneven data: ranks that run out of batches call hvd.join(), keep averaging with
    their groups, and every rank leaves at the same step, over two epochs and three configurations."""
    output = run(launcher, 4, "torch_join.py", timeout=240)
    assert output.count("all checks passed") == 4, output


def test_sparse_embedding_averaging_equals_dense():
    """Embedding tables averaged over the rows in play equal dense averaging step by step (pairs, warm-up,
    global averages, a checkpoint), for far fewer bytes; optimizers that move unreported rows go dense."""
    output = run("gloo", 4, "torch_sparse.py", timeout=300)
    assert output.count("all checks passed") == 4, output


def test_sparse_benchmark_example_runs():
    """examples/pytorch_sparse_benchmark.py, tiny, on 2 ranks: every variant trains and reports its bytes."""
    output = run("gloo", 2, f"{ROOT}/examples/pytorch_sparse_benchmark.py", "--rows", 26000, "--steps", 8,
                 timeout=300)
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in output.splitlines() if line.count("|") == 8}
    assert {"horovod-sparse", "horovod-sparse-as-dense", "dssync-dense", "dssync-sparse"} <= set(rows), output
    assert float(rows["dssync-sparse"][1]) < float(rows["dssync-dense"][1]), output
    # The held-out AUC: sparse averaging gives the dense model, so the same scores.
    assert 0.0 < float(rows["dssync-sparse"][5]) <= 1.0, output
    assert abs(float(rows["dssync-sparse"][5]) - float(rows["dssync-dense"][5])) < 1e-3, output


@pytest.mark.parametrize("launcher,init", [("gloo", "dynamic"), ("mpi", "static")])
def test_process_sets_and_fp16_compression(launcher, init):
    """Two process sets train side by side (exact group means, global ranks); bad sets refused; fp16 keeps
    updates below its resolution, within its error bound of the exact group means. Static: one SyncConfig
    registers the groups (``init(sync=)``) and builds the optimizers; dynamic: the keywords."""
    # The ranks outside a set never build its optimizer there: its ranks' agreement gives up after 5 s.
    output = run(launcher, 4, "torch_process_sets.py", "--init", init, timeout=300,
                 env={"HVD_DSSYNC_AGREE_SECONDS": "5"})
    assert output.count("all checks passed") == 4, output


@pytest.mark.parametrize("launcher,np", [*matrix(sizes=(2, 4, 8)), pytest.param("gloo", 16, id="gloo-np16", marks=pytest.mark.wide),
                                         pytest.param("mpi", 16, id="mpi-np16", marks=pytest.mark.wide)])
def test_ranks_outside_the_optimizers_process_set_train_alone(launcher, np):
    """Every rank builds the optimizer of the even ranks' set: the odd ranks train alone and send nothing;
    at 8 and 16 ranks the set's groups are registered by every rank together."""
    output = run(launcher, np, "torch_outside_set.py", timeout=240)
    assert output.count("all checks passed") == np, output


@pytest.mark.parametrize("launcher", ["gloo"])
def test_ranks_building_with_different_process_sets_all_raise(launcher):
    """Ranks 0-3 build the optimizer with the even ranks' set, ranks 4-7 with the odd ranks': the groups cannot
    be registered together, and every rank raises the same error."""
    output = run(launcher, 8, "torch_mixed_sets.py", timeout=180)
    assert output.count("all checks passed") == 8, output


@pytest.mark.parametrize("launcher,np", matrix(sizes=(4,)))
def test_the_default_senses_one_host_and_keeps_its_schedule(launcher, np):
    """On one host (loopback) topology='auto' finds one host with no probe and keeps random groups."""
    output = run(launcher, np, "torch_sensing.py", timeout=240)
    assert output.count("all checks passed") == np, output
