"""The test harness itself: a job that ends in Horovod's Gloo background-loop timeout runs once more."""
import pytest

from multirank import GlooDeadlockRetry, JobFailed, gloo_deadlock, run


def test_gloo_deadlock_signature():
    assert gloo_deadlock("[1]: Horovod background loop uncaught exception: [.../unbound_buffer.cc:81] "
                         "Timed out waiting 60000ms for recv operation to complete")
    assert not gloo_deadlock("[1]: Horovod background loop uncaught exception: Connection reset by peer")
    assert not gloo_deadlock("AssertionError: rank 1: unnamed allreduce gave 3.0")


def test_gloo_timeout_runs_once_more(tmp_path):
    with pytest.warns(GlooDeadlockRetry, match="running it once more"):
        output = run("gloo", 2, "gloo_timeout_once.py", tmp_path / "marker", timeout=60)
    assert output.count(": ran\n") == 2, output


def test_gloo_timeout_twice_fails(tmp_path):
    with pytest.raises(JobFailed, match="send operation"), pytest.warns(GlooDeadlockRetry):
        run("gloo", 2, "gloo_timeout_once.py", tmp_path / "marker", "always", timeout=60)


def test_other_failures_do_not_run_again(tmp_path):
    with pytest.raises(JobFailed):
        run("mpi", 2, "gloo_timeout_once.py", tmp_path / "marker", timeout=60)
    assert (tmp_path / "marker").exists()
