"""The watchdog that bounds a DS-Sync average: alone (unit), then a silent rank in real jobs."""
import io
import re
import threading
import time

import pytest

from hvd_dssync.watchdog import TIMEOUT_ENV, Watchdog, describe_wait, timeout_from_env
from multirank import crossed, run


class _Shutdown:
    def __init__(self):
        self.calls = 0
        self.done = threading.Event()

    def __call__(self):
        self.calls += 1
        self.done.set()


def test_a_wait_that_ends_in_time_shuts_nothing_down():
    shutdown = _Shutdown()
    watchdog = Watchdog(0.3, shutdown, stream=io.StringIO())
    for _ in range(5):
        with watchdog.watching("rank 0 waits for ranks [1]"):
            time.sleep(0.05)
    time.sleep(0.5)
    assert shutdown.calls == 0 and watchdog.expired is None


def test_an_expired_wait_names_itself_and_shuts_down_once():
    shutdown, stream = _Shutdown(), io.StringIO()
    watchdog = Watchdog(0.2, shutdown, stream=stream)
    watchdog.arm("rank 0 waits for ranks [1] to average at step 7 (group)")
    watchdog.arm("rank 0 waits for ranks [1, 2] to average at step 8 (global)")
    assert shutdown.done.wait(5)
    time.sleep(0.3)
    assert shutdown.calls == 1
    assert "rank 0 waits for ranks [1] to average at step 7 (group)" in watchdog.expired
    assert f"not completed after 0.2 s ({TIMEOUT_ENV})" in watchdog.expired
    assert stream.getvalue().strip() == watchdog.expired


def test_a_later_deadline_is_kept_after_an_earlier_wait_ends():
    shutdown = _Shutdown()
    watchdog = Watchdog(0.4, shutdown, stream=io.StringIO())
    first = watchdog.arm("first")
    time.sleep(0.2)
    watchdog.arm("second")
    watchdog.disarm(first)
    assert not shutdown.done.wait(0.1)  # "first" would have expired at 0.4 s; "second" expires at 0.6 s
    assert shutdown.done.wait(5) and watchdog.expired.startswith("hvd_dssync: second")


def test_a_wait_names_the_peers_step_and_kind():
    assert describe_wait(1, (0, 1, 3), 12, "group") == "rank 1 waits for ranks [0, 3] to average at step 12 (group)"


def test_no_timeout_never_arms():
    watchdog = Watchdog(None, _Shutdown())
    assert watchdog.arm("anything") is None
    assert watchdog._thread is None


@pytest.mark.parametrize("value,expected", [("", 1800.0), ("12.5", 12.5), ("0", None)])
def test_timeout_from_env(monkeypatch, value, expected):
    monkeypatch.setenv(TIMEOUT_ENV, value)
    assert timeout_from_env() == expected


@pytest.mark.parametrize("value", ["ten", "-1"])
def test_bad_timeout_is_named(monkeypatch, value):
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV} must be a number of seconds"):
        timeout_from_env()


FRAMEWORKS = crossed({"torch": "reliability_train.py", "keras": "reliability_keras.py"})


@pytest.mark.multirank
@pytest.mark.parametrize("launcher,worker", FRAMEWORKS)
def test_silent_rank_stops_the_job(launcher, worker):
    """Rank 1 stays alive but stops calling Horovod at step 10; with a 20 s bound the job ends, saying why."""
    started = time.monotonic()
    # 20 s: a first average under Gloo, which also sets up each new process set's context, took over 10 s
    # once on 2 loaded cores, and the watchdog then rightly stopped the job before the planned stall.
    output = run(launcher, 3, worker, "stall", "--at", 10, timeout=150, expect_failure=True,
                 env={TIMEOUT_ENV: "20"})
    elapsed = time.monotonic() - started
    assert "rank 1: stall at step 10" in output, output
    assert "to average at step" in output and f"has not completed after 20 s ({TIMEOUT_ENV})" in output, output
    assert elapsed < 150


# What an expired wait says: "rank R waits for ranks [P, ...] to average at step K (kind)".
WAIT_LINE = re.compile(r"rank (\d+) waits for ranks \[([\d, ]*)\] to average at step (\d+) \((\w+)\)")


@pytest.mark.multirank
def test_a_silent_rank_in_a_global_average_through_the_racks_is_named_by_its_partners():
    """Rank 1 falls silent at a global average through the racks [[0, 1], [2, 3]] (the speakers: 1 and 3; 0
    and 2 each issue their tiny op alone). Each rank waits in one of the route's three averages, for the
    members of that op only: 0 for 1 in its rack's, 3 for 1 across the racks, 2 for 3 in its rack's last;
    what expires names that one rank, and the kind of the whole (global)."""
    output = run("gloo", 4, "reliability_train.py", "stall", "--at", 10, "--through-racks", timeout=150,
                 expect_failure=True, env={TIMEOUT_ENV: "20"})
    at = int(re.search(r"rank 1: stall at step (\d+)", output).group(1))
    waits = {int(rank): ([int(p) for p in peers.split(", ")], int(step), kind)
             for rank, peers, step, kind in WAIT_LINE.findall(output)}
    assert waits, output
    expected = {0: [1], 2: [3], 3: [1]}
    for rank, (peers, step, kind) in waits.items():
        assert (peers, step, kind) == (expected[rank], at, "global"), (rank, output)
