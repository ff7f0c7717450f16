"""The emulated cluster and the benchmark: a smoke run on two namespaces, stale clean-up, the report.

The namespace tests need root and network namespaces; elsewhere they are skipped with the reason.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_dssync.bench import report
from hvd_dssync.bench.testbed import Testbed, cleanup_stale, namespaces_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_AVAILABLE, _WHY = namespaces_available()
needs_namespaces = pytest.mark.skipif(not _AVAILABLE, reason=f"network namespaces are not allowed here: {_WHY}")

SMOKE_CONFIG = {"seed": 0, "hidden": 32, "batch": 8, "lr": 0.1, "momentum": 0.9, "steps": 4, "eval_every": 2,
                "max_train_seconds": 20, "calibration_steps": 2, "racks": [[0], [1]], "local_period": 2,
                "warmup_steps": 0, "target": 0.9}


def _leftovers(run_id):
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line for line in (namespaces + links).splitlines() if run_id in line]


@needs_namespaces
@pytest.mark.multirank
def test_smoke_two_namespaces_dssync_crosses_the_shaped_link_and_is_torn_down():
    from hvd_dssync.bench.contenders import run_contender

    started = time.monotonic()
    with Testbed(racks=[1, 1], intra_mbit=100, inter_mbit=20) as bed:
        run_id = bed.run_id
        assert os.path.exists(f"/etc/netns/{bed.namespace(0)}/hosts")
        record = run_contender(bed, "dssync-butterfly", SMOKE_CONFIG, timeout=50)
    assert _leftovers(run_id) == []
    assert not os.path.exists(f"/etc/netns/{run_id}-h0")
    assert record["steps"] == 4 and record["size"] == 2
    assert not record["hostname_loopback"], "the namespace's hosts file should map the hostname"
    # Four averagings of the whole model cross the one inter-rack link, in each direction.
    crossed = record["links"]["total"]
    assert len(crossed) == 2 and min(crossed.values()) >= 4 * record["model_bytes"]
    row = report.summarize(record, {"name": "static", "inter_mbit": 20, "rate_change": None}, SMOKE_CONFIG)
    assert row["sync_to_link_bound"] > 0 and row["bottleneck_bytes"] == max(crossed.values())
    assert time.monotonic() - started < 60


@needs_namespaces
def test_a_killed_run_is_cleaned_up_by_the_next():
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from hvd_dssync.bench.testbed import Testbed\n"
            "bed = Testbed(racks=[1, 1]); bed.create(); print(bed.run_id, flush=True); time.sleep(60)" % ROOT)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id.startswith("dss") and _leftovers(run_id)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert run_id in cleanup_stale()
    assert _leftovers(run_id) == []


def test_estimated_bottleneck_bytes_follow_the_ring():
    racks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    config = {"seed": 0, "local_period": 4, "warmup_steps": 0}
    # Ring allreduce over 8 ranks: one ring edge per direction crosses, 2 (n-1)/n of the model on it.
    assert report.estimate_bottleneck_bytes("horovod-bsp", 10, racks, 1000, config) == pytest.approx(10 * 1750)
    # Topology-aware: one bridge pair per 4 steps; a pair's ring sends the whole model each way.
    assert report.estimate_bottleneck_bytes("dssync-topology", 8, racks, 1000, config) == pytest.approx(2 * 1000)
    assert report.estimate_bottleneck_bytes("postlocal-periodic", 8, racks, 1000, config) == pytest.approx(2 * 1750)


def test_report_table_and_targets():
    def row(scenario, contender, t, acc, step):
        return {"scenario": scenario, "contender": contender, "steps": 10, "median_step_s": step,
                "throughput_samples_s": 100.0, "time_to_target_s": t, "final_accuracy": acc,
                "bottleneck_bytes": 2e6, "bottleneck_bytes_estimate": 1.9e6, "sync_to_link_bound": 1.1,
                "train_seconds": 9.0}
    rows = [row("static", "horovod-bsp", 10.0, 0.96, 0.5), row("static", "dssync-topology", 4.0, 0.958, 0.1),
            row("none", "horovod-bsp", None, 0.9, 0.1), row("none", "dssync-topology", None, 0.9, 0.2)]
    table = report.markdown_table(rows, 0.95)
    assert "| static | dssync-topology | 10 | 0.100 |" in table and "not reached" in table
    checks = {t.split(":")[0]: met for t, met, _ in report.targets(rows)}
    assert checks == {"static bottleneck": True, "no bottleneck": False,
                      "DS-Sync's synchronization time within 1.25x of the link-bound limit": True}


def test_loopback_hostname_in_a_multi_host_job_warns(monkeypatch):
    from hvd_dssync.bench import worker

    monkeypatch.setenv("HOROVOD_CROSS_SIZE", "2")
    monkeypatch.setattr(worker.socket, "gethostbyname", lambda name: "127.0.1.1")
    with pytest.warns(UserWarning, match="resolves to 127.0.1.1"):
        assert worker.warn_if_hostname_is_loopback()
    monkeypatch.setenv("HOROVOD_CROSS_SIZE", "1")
    assert not worker.warn_if_hostname_is_loopback()


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from hvd_dssync.bench.plot import main

    curve = [{"step": 1, "time": 0.5, "train_loss": 2.0, "test_loss": 2.0, "accuracy": 0.3},
             {"step": 2, "time": 1.0, "train_loss": 1.0, "test_loss": 1.0, "accuracy": 0.96}]
    payload = {"config": {"target": 0.95},
               "runs": [{"scenario": "static", "contender": "horovod-bsp", "record": {"curve": curve}}],
               "rows": [{"scenario": "static", "contender": "horovod-bsp", "time_to_target_s": 1.0,
                         "train_seconds": 1.0}]}
    (tmp_path / "results.json").write_text(json.dumps(payload))
    assert main([str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "loss_accuracy_static.png").exists() and (tmp_path / "time_to_accuracy.png").exists()


@needs_namespaces
@pytest.mark.multirank
def test_probe_topology_finds_the_racks_behind_the_slow_link():
    """4 emulated hosts, 2 racks joined by a link 10x slower: the probe's timings recover the racks."""
    from hvd_dssync.bench.contenders import _start_rendezvous, rank_env

    worker = os.path.join(ROOT, "tests", "workers", "torch_probe.py")
    with Testbed(racks=[2, 2], intra_mbit=200, inter_mbit=20) as bed:
        rendezvous, port = _start_rendezvous(bed, time.monotonic() + 90)
        procs = [bed.popen(rank, [sys.executable, worker], env=rank_env(bed, rank, "dssync-topology", port),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(bed.size)]
        try:
            outputs = [proc.communicate(timeout=90)[0] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            rendezvous.stdin.close()
            rendezvous.wait(timeout=10)
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)
    racks = [json.loads(line[6:]) for line in outputs[0].splitlines() if line.startswith("RACKS ")]
    assert racks == [[[0, 1], [2, 3]]], outputs[0]
