"""The test harness itself: every job runs once, under its timeout, and its whole process group goes."""
import os
import subprocess

import pytest

from multirank import JobFailed, command, run


def test_gloo_jobs_use_horovods_own_timeout():
    assert "--gloo-timeout-seconds" not in command("gloo", 2, ["worker.py"])


def test_a_failing_job_is_not_run_again(tmp_path):
    """A job that ends in Horovod's Gloo background-loop timeout fails at once: flaky is failing."""
    with pytest.raises(JobFailed, match="recv operation"):
        run("gloo", 2, "gloo_timeout_once.py", tmp_path / "marker", timeout=60)
    assert (tmp_path / "marker").exists()


def test_a_hung_job_fails_and_leaves_no_rank_behind(tmp_path):
    with pytest.raises(JobFailed, match="hung past"):
        run("mpi", 2, "gloo_timeout_once.py", tmp_path / "marker", "hang", timeout=20)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "marker")], capture_output=True, text=True).stdout.split()
    assert [p for p in left if int(p) != os.getpid()] == [], "ranks of the killed job are still running"
