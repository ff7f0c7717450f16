"""``python -m hvd_dssync``: the subcommands run in a subprocess, as a user runs them."""
import json
import re
import subprocess
import sys

import pytest

from hvd_dssync.__main__ import main

ROOT = __file__.rsplit("/tests/", 1)[0]


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hvd_dssync", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def table_rows(text):
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| N ")]


def test_simulate_prints_a_table_of_every_schedule(tmp_path):
    path = tmp_path / "out" / "sim.json"
    result = run_cli("simulate", "--workers", "8,64", "--steps", "300", "--json", str(path))
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert [(r[0], r[2]) for r in rows] == [(n, s) for n in ("8", "64")
                                            for s in ("bsp", "shuffle", "butterfly", "topology")]
    bsp64 = rows[4]
    assert bsp64[1] == "8" and bsp64[6] == "1" and bsp64[7] == "197"  # 2 * 63/64 * 100 MB, 8 racks
    assert json.loads(path.read_text())[4]["uplink_mb_per_step"] == pytest.approx(2 * 63 / 64 * 100)


def test_simulate_options_reach_the_simulator():
    result = run_cli("simulate", "--workers", "16", "--schedule", "bsp", "--model-mb", "10",
                     "--cross-rack-gbps", "2", "--rack-size", "4")
    assert result.returncode == 0, result.stderr
    (row,) = table_rows(result.stdout)
    assert row[1] == "4" and row[7] == "18.8" and row[8] == "75"  # 2*15/16*10 MB at 2 Gb/s


def test_racks_reads_recorded_figures_and_says_its_margin(tmp_path):
    """An optimizer's recorded opt.sensed (the accelerator network's figures that a rule of one pair split into
    five racks): two racks and the margin; a stricter margin finds one flat network and names the pairs in
    doubt; figures of one pair find no structure."""
    from test_sensing import RECORDED

    words = RECORDED.split()
    sensed = tmp_path / "sensed.json"
    by_pair = dict(zip(words[::2], map(float, words[1::2])))
    sensed.write_text(json.dumps({"how": "measured", "seconds_by_pair": by_pair}))
    result = run_cli("racks", str(sensed))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8 hosts (first ranks [0, 1, 2, 3, 4, 5, 6, 7]): 2 racks [[0, 1, 2, 3], " \
                                    "[4, 5, 6, 7]]; margin 2.7x"
    strict = run_cli("racks", str(sensed), "--min-margin", "3").stdout.splitlines()
    assert strict == ["8 hosts (first ranks [0, 1, 2, 3, 4, 5, 6, 7]): one flat network; no clear margin "
                      "(widest 2.7x, 3x needed)", "pairs in doubt (timed again by the probe): 2-4, 3-6, 5-6"]
    pair = tmp_path / "pair.json"
    pair.write_text('{"0-2": 0.01}')
    assert "one flat network; no rack structure" in run_cli("racks", str(pair)).stdout


@pytest.mark.parametrize("args,message", [
    (("racks", "/nonexistent/sensed.json"), "cannot read pair figures"),
    (("simulate", "--workers", "8,x"), "integers separated by commas"),
    (("simulate", "--workers", "1"), "world sizes of at least 2"),
    (("simulate", "--schedule", "ring"), "expected names among"),
    (("simulate", "--workers", "8", "--num-groups", "9"), "``num_groups`` must be at most the world size 8"),
    (("info", "-np", "4", "--schedule", "butterfly", "--num-groups", "2"), "does not apply"),
    (("info", "-np", "0"), "positive integer"),
    (("nothing",), "invalid choice"),
])
def test_bad_arguments_exit_2_with_a_message(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.fixture(scope="module")
def info4():
    return run_cli("info", "-np", "4")


def test_info_reports_versions_and_horovod_build(info4):
    assert info4.returncode == 0, info4.stderr
    out = info4.stdout
    assert re.search(r"^numpy\s+\d+\.\d+", out, re.M)
    assert re.search(r"^python\s+3\.", out, re.M)
    for module in ("torch", "tensorflow", "horovod"):
        assert re.search(rf"^{module}\s+(\d+\.\d+|not installed)", out, re.M), module
    built = re.search(r"^built with\s+(.*)$", out, re.M).group(1)
    if "not installed" in re.search(r"^horovod\s+(.*)$", out, re.M).group(1):
        assert built.startswith("not available")
    else:
        for name in ("PyTorch", "TensorFlow", "Gloo", "MPI"):
            assert re.search(rf"{name} (yes|no)", built), built


def test_info_shows_the_groups_and_process_sets_of_four_ranks(info4):
    from hvd_dssync.schedules import Shuffle
    schedule = Shuffle(4, num_groups=2, seed=0)
    out = info4.stdout
    for step in range(4):
        groups = " ".join("[" + " ".join(map(str, g)) + "]" for g in schedule.groups(step))
        assert re.search(rf"step {step}\s+{re.escape(groups)}$", out, re.M), out
    sets = schedule.window_groups(0)
    assert f"window 0 (all steps): {len(sets)} sets:" in out


def test_info_topology_schedule_lists_the_racks():
    result = run_cli("info", "-np", "8", "--schedule", "topology", "--rack-size", "4", "--no-build-check")
    assert result.returncode == 0, result.stderr
    assert "racks       [0 1 2 3] [4 5 6 7]" in result.stdout
    assert re.search(r"step 3\s+\[0 1 2\] \[3 7\] \[4 5 6\]", result.stdout)
    assert "built with" not in result.stdout


def test_bench_and_plot_dispatch_or_explain(monkeypatch, capsys):
    import importlib
    calls = []

    class Fake:
        @staticmethod
        def main(argv):
            calls.append(argv)
            return 3

    real_import = importlib.import_module

    def fake_import(name, *args):
        if name == "hvd_dssync.bench.cli":
            return Fake
        if name == "hvd_dssync.bench.plot":
            raise ImportError("no plotting here")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert main(["bench", "--ranks", "4", "--help"]) == 3
    assert calls == [["--ranks", "4", "--help"]]
    assert main(["plot", "x.json"]) == 2
    assert "cannot import hvd_dssync.bench.plot" in capsys.readouterr().err


def test_console_entry_point_returns_a_status():
    assert main(["simulate", "--workers", "4", "--schedule", "butterfly", "--steps", "10"]) == 0
