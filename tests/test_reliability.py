"""Issue #6: fail fast and clearly, lose nothing. Unit tests of the messages, then real multi-rank jobs:
bad inputs, disagreeing ranks, a rank killed mid-training, checkpoint and resume, elastic Horovod.

Every job runs under a timeout and is killed with its whole process group (tests/multirank.py).
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from hvd_dssync.plan import SyncPlan, agreement_fields, agreement_payload, check_agreement
from hvd_dssync.process_sets import ProcessSetRegistry
from hvd_dssync.schedules import UserSchedule
from hvd_dssync.topology import Topology
from multirank import ROOT, WORKERS, crossed, job_env, kill_session, matrix, run


# --- messages, without Horovod -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(num_groups=0), ValueError, "``num_groups`` must be at least 1"),
    (dict(num_groups=5), ValueError, "``num_groups`` must be at most the world size 4"),
    (dict(num_groups=2, group_size=2), ValueError, "exactly one of ``num_groups`` and ``group_size``"),
    (dict(group_size=5), ValueError, "``group_size`` must be at most the world size 4"),
    (dict(num_groups=2, seed=1.0), TypeError, "``seed`` must be an integer"),
    (dict(num_groups=2, seed=None), TypeError, "``seed`` must be an integer"),
    (dict(num_groups=2, schedule="random"), ValueError, "``schedule`` must be one of"),
    (dict(schedule="topology"), ValueError, "needs a topology"),
], ids=["num_groups=0", "num_groups>size", "both", "group_size>size", "seed-float", "seed-none",
        "schedule-name", "topology-missing"])
def test_bad_plan_arguments(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(")):
        SyncPlan(0, 4, **kwargs)


class _Schedule:
    world_size = 3

    def __init__(self, partition):
        self.partition = partition

    def groups(self, step):
        return self.partition


@pytest.mark.parametrize("partition,fragment", [
    ([[0, 1]], "leaves ranks [2] out of every group"),
    ([[0, 1], [1, 2]], "puts rank 1 in more than one group"),
    ([[0, 1, 2, 7]], "names rank 7, outside 0..2"),
    ([[0, 1, 2], []], "has an empty group"),
])
def test_user_schedule_must_cover_every_rank_once(partition, fragment):
    with pytest.raises(ValueError) as e:
        UserSchedule(_Schedule(partition), 3)
    assert fragment in str(e.value) and "schedule.groups(0)" in str(e.value)


def test_user_schedule_must_be_deterministic():
    class Flips(_Schedule):
        calls = 0

        def groups(self, step):
            self.calls += 1
            return [[0, 1, 2]] if self.calls % 2 else [[0], [1, 2]]

    with pytest.raises(ValueError, match="different partitions when called twice"):
        UserSchedule(Flips(None), 3)


@pytest.mark.parametrize("spec,hosts,fragment", [
    ("[[0], oops", None, "neither a file nor valid JSON"),
    ({"racks": [[0]], "colour": 1}, None, "unknown keys"),
    ([[0, 1], [1]], None, "exactly once"),
    ([[0], [5]], None, "exactly once"),
    ([["a"], ["zz"]], ["a", "b"], "zz"),
    ([[0, 1]], ["a", "a", "b"], "names 2 ranks, but the job has 3"),
])
def test_bad_topology(spec, hosts, fragment):
    with pytest.raises(ValueError, match=fragment):
        Topology.parse(spec, hosts)


def test_disagreement_names_arguments_values_and_ranks():
    def payload(**kwargs):
        arguments = dict(num_groups=2, seed=0)
        arguments.update(kwargs)
        return agreement_payload(agreement_fields(SyncPlan(0, 4, **arguments), [("w", (2,), "float32")],
                                                  {"overlap": False}, step=0))

    agree = payload()
    assert len(check_agreement(np.concatenate([agree] * 4))) == 4  # no error
    rows = np.concatenate([agree, payload(seed=1), agree, payload(seed=1, warmup_steps=3)])
    with pytest.raises(ValueError) as e:
        check_agreement(rows, what="X")
    message = str(e.value)
    assert message.startswith("X: ranks disagree on")
    assert "seed (rank 0 has 0, rank 1 has 1, rank 3 has 1)" in message
    assert "warmup_steps (rank 0 has 0, rank 3 has 3)" in message
    assert "groups" not in message  # explained by the seed


def test_disagreement_on_the_groups_alone_is_named():
    """Equal arguments but other groups (e.g. another NumPy's random stream): the groups are named."""
    plan = SyncPlan(0, 4, num_groups=2, seed=0)
    other = SyncPlan(0, 4, num_groups=2, seed=0)
    other.schedule._cache[0] = (((0, 3), (1, 2)), ((0, 1), (2, 3)))
    rows = np.concatenate([agreement_payload(agreement_fields(p)) for p in (plan, other)])
    with pytest.raises(ValueError, match=r"ranks disagree on groups \(rank 0 has \w+, rank 1 has \w+\)"):
        check_agreement(rows)


def test_the_step_rides_along_uncompared():
    plan = SyncPlan(0, 2, num_groups=1)
    rows = np.concatenate([agreement_payload(agreement_fields(plan, step=s)) for s in (7, 0)])
    assert [r["step"] for r in check_agreement(rows)] == [7, 0]


class _FakeHorovod:
    """Just enough of a Horovod module for the registry's bookkeeping."""

    def __init__(self, size, rank=0):
        self.world = (size, rank)
        self.global_process_set = "global"

    def size(self):
        return self.world[0]

    def rank(self):
        return self.world[1]


def test_registry_forgets_its_sets_in_a_new_world():
    hvd = _FakeHorovod(4)
    registry = ProcessSetRegistry(hvd)
    first = registry.refresh()
    assert registry.refresh() == first  # same world: nothing forgotten
    registry._sets[(0, 1)] = object()
    hvd.world = (3, 0)  # an elastic reset to three ranks
    assert registry.refresh() == first + 1
    assert registry.live_groups() == ()
    hvd.world = (3, 1)  # same size, another rank: a new world too
    assert registry.refresh() == first + 2


def test_registry_marks_sets_ordered_unless_a_user_needs_them_negotiated(monkeypatch):
    """Every acquired set is marked ordered once; an acquirer that needs it negotiated (sparse averaging)
    unmarks it for good; HVD_DSSYNC_ORDERED_SETS=0 marks nothing. The calls are the same on every rank."""
    from hvd_dssync import process_sets

    calls = []
    monkeypatch.setattr(process_sets, "mark_ordered", lambda ps, ordered=True: calls.append((ps, ordered)))
    monkeypatch.setattr(process_sets, "_horovod_table", lambda: {})  # no set registered at init
    monkeypatch.setattr(process_sets, "_table_size", lambda: 0)
    hvd = _FakeHorovod(4)
    hvd.add_process_set = lambda ranks: f"set{ranks}"
    registry = ProcessSetRegistry(hvd)
    registry.acquire([(0, 1), (2, 3)])
    registry.acquire([(0, 1)])  # a second user: already ordered, nothing to mark
    registry.acquire([(0, 1)], ordered=False)  # sparse averaging gathers rows on it
    registry.acquire([(0, 1)])  # stays negotiated
    assert calls == [("set[0, 1]", True), ("set[2, 3]", True), ("set[0, 1]", False)]
    calls.clear()
    monkeypatch.setenv(process_sets.ORDERED_ENV, "0")
    registry.acquire([(1, 2)])
    assert calls == []


def test_sets_registered_ahead_are_taken_up_without_adding_them_again(monkeypatch):
    """register_ahead adds the sets on a thread; acquire takes them up without adding them again (no
    collective at the step that follows the new groups) and marks them ordered; release_unused removes those nobody
    acquired; refresh does not list Horovod's table while sets are being added (it cannot: the listing raises
    on a set not agreed on yet); registering waits for the thread first, and what failed there is raised on the
    training thread."""
    import threading
    from types import SimpleNamespace

    from hvd_dssync import process_sets

    added, removed, marked = [], [], []
    release = threading.Event()
    monkeypatch.setattr(process_sets, "mark_ordered", lambda ps, ordered=True: marked.append((ps.name, ordered)))
    monkeypatch.setattr(process_sets, "_horovod_table", lambda: {})
    monkeypatch.setattr(process_sets, "_table_size", lambda: len(added))
    hvd = _FakeHorovod(8)

    def add(ranks):
        release.wait(10)  # Horovod's add blocks until every rank has added the set
        added.append(tuple(ranks))
        return SimpleNamespace(name=f"set{ranks}", process_set_id=len(added), ranks=list(ranks))

    hvd.add_process_set, hvd.remove_process_set = add, lambda ps: removed.append(ps.name)
    registry = ProcessSetRegistry(hvd)
    assert registry.register_ahead([(4, 5, 6, 7), (0, 1, 2, 3), (3, 7), tuple(range(8))]) == \
        [(0, 1, 2, 3), (3, 7), (4, 5, 6, 7)]  # sorted; the whole world is the global set
    assert not registry.ahead_done() and added == []
    release.set()
    registry.acquire([(0, 1, 2, 3), (4, 5, 6, 7)])  # waits for the thread, adds nothing more
    assert registry.ahead_done() and added == [(0, 1, 2, 3), (3, 7), (4, 5, 6, 7)]
    assert marked == [("set[0, 1, 2, 3]", True), ("set[4, 5, 6, 7]", True)]  # the sets acquired, once each
    registry.acquire([(0, 1, 2, 3)])
    assert len(marked) == 2
    registry.release_unused()
    assert removed == ["set[3, 7]"] and registry.live_groups() == ((0, 1, 2, 3), (4, 5, 6, 7))

    # From racks to other racks: the old sets stay live while the new ones are added.
    table = {1: [0, 1, 2, 3], 3: [4, 5, 6, 7]}
    monkeypatch.setattr(process_sets, "_horovod_table", lambda: table)
    generation = registry.refresh()
    release.clear()
    registry.register_ahead([(0, 1, 2), (3, 4, 5, 6, 7)])
    monkeypatch.setattr(process_sets, "_horovod_table", lambda: pytest.fail("listed while sets were added"))
    assert registry.refresh() == generation
    release.set()
    registry.acquire([(0, 1, 2), (3, 4, 5, 6, 7)])
    monkeypatch.setattr(process_sets, "_horovod_table", lambda: {})  # every set gone: Horovod re-initialized
    assert registry.refresh() == generation + 1

    def refuse(ranks):
        raise ValueError("HOROVOD_DYNAMIC_PROCESS_SETS is not set")

    hvd.add_process_set = refuse
    registry.register_ahead([(0, 1)])
    with pytest.raises(RuntimeError, match="dynamic process sets"):
        registry.acquire([(0, 1)])


# --- multi-rank jobs -----------------------------------------------------------------------------

MULTIRANK = pytest.mark.multirank
SIZES = matrix(sizes=(2, 3))


@MULTIRANK
@pytest.mark.parametrize("launcher,np", SIZES)
def test_bad_inputs_raise_identically_before_any_communication(launcher, np):
    """Each bad argument and each disagreement: same message on every rank, no stray op (unnamed ops after)."""
    output = run(launcher, np, "reliability_inputs.py", timeout=240)
    assert output.count("all checks passed") == np, output


FRAMEWORKS = crossed({"torch": "reliability_train.py", "keras": "reliability_keras.py"})


@MULTIRANK
@pytest.mark.parametrize("launcher,worker", FRAMEWORKS)
def test_killed_rank_stops_the_job(launcher, worker):
    """Rank 1 is SIGKILLed at step 10 of an endless loop; the job must fail, not hang, and say why."""
    started = time.monotonic()
    output = run(launcher, 3, worker, "kill", "--at", 10, timeout=150, expect_failure=True)
    elapsed = time.monotonic() - started
    assert "rank 1: kill at step 10" in output, output
    assert any(reason in output for reason in ("Connection reset by peer", "exited on signal 9",
                                               "status code 137", "Horovod has been shut down")), output
    assert elapsed < 150


@MULTIRANK
@pytest.mark.parametrize("launcher,worker", FRAMEWORKS)
def test_checkpoint_resume_is_bit_identical(launcher, worker, tmp_path):
    """Train 13 steps; or train 5, save, restart the job, resume to 13: every rank's weights bit-equal."""
    run(launcher, 3, worker, "full", "--steps", 13, "--dir", tmp_path, timeout=200)
    run(launcher, 3, worker, "save", "--steps", 5, "--dir", tmp_path, timeout=200)
    output = run(launcher, 3, worker, "resume", "--steps", 13, "--dir", tmp_path, timeout=200)
    assert output.count("resumed at step 5, equal to the uninterrupted run at step 13") == 3, output


@MULTIRANK
def test_checkpoint_resumes_on_fewer_ranks(tmp_path):
    """Saved by 3 ranks at step 5, resumed by 2: the schedule of the new world, from step 5; other arguments
    are refused, naming both."""
    run("gloo", 3, "reliability_train.py", "save", "--steps", 5, "--dir", tmp_path, timeout=200)
    output = run("gloo", 2, "reliability_train.py", "reshape", "--steps", 9, "--dir", tmp_path, timeout=200)
    assert output.count("resumed at step 5 in a world of 2, trained on to step 9") == 2, output


def _elastic_job(tmp_path, worker, first_hosts, np, min_np, max_np, *worker_args, timeout=300):
    """horovodrun elastic on localhost with a discovery script reading a host file the worker rewrites.

    Runs ``tests/workers/<worker> HOSTFILE *worker_args``; returns (exit code, output). The job is killed
    with its whole process group past ``timeout`` seconds.
    """
    hosts = tmp_path / "hosts"
    hosts.write_text(first_hosts + "\n")
    discovery = tmp_path / "discover.sh"
    discovery.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discovery.chmod(0o755)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np),
           "--host-discovery-script", str(discovery), "--network-interface", "lo",
           sys.executable, os.path.join(WORKERS, worker), str(hosts), *map(str, worker_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=job_env("gloo"), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"elastic job {worker} hung past {timeout}s; output:\n{output}")
    finally:
        kill_session(proc.pid)
    return proc.returncode, output


@MULTIRANK
def test_elastic_worker_removed_mid_run(tmp_path):
    """hvd.elastic.run with TorchState: 3 workers, the host file shrinks to 2 slots at step 8 of 30."""
    code, output = _elastic_job(tmp_path, "reliability_elastic.py", "localhost:3", 3, 2, 3, 30, 8, "localhost:2")
    assert code == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: sizes [3, 2], finished at step 30 in a world of 2" in output, output


@MULTIRANK
def test_elastic_worker_added_mid_run(tmp_path):
    """2 workers, 3 from step 8 of 30: the newcomer builds without communicating and takes rank 0's step."""
    code, output = _elastic_job(tmp_path, "reliability_elastic.py", "localhost:2", 2, 2, 3, 30, 8, "localhost:3")
    assert code == 0, output
    assert output.count("sizes [2, 3], finished at step 30 in a world of 3") == 2, output
    assert output.count("sizes [3], finished at step 30 in a world of 3") == 1, output


def _keras_elastic_job(tmp_path, first_hosts, np, min_np, max_np, new_hosts, epochs, change_at, *options,
                       timeout=300):
    """The Keras worker: ``keras_elastic.py HOSTFILE EPOCHS CHANGE_AT NEW_HOSTS [--state ...]``."""
    return _elastic_job(tmp_path, "keras_elastic.py", first_hosts, np, min_np, max_np, epochs, change_at, new_hosts,
                        *options, timeout=timeout)


@MULTIRANK
def test_keras_elastic_worker_removed_mid_run(tmp_path):
    """Keras model.fit under hvd.elastic.run with dss.elastic.KerasState: 3 workers, 2 from epoch 4 of 12."""
    code, output = _keras_elastic_job(tmp_path, "localhost:3", 3, 2, 3, "localhost:2", 12, 4)
    assert code == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: sizes [3, 2], finished at step 24 in a world of 2, last group [0, 1] averaged, " \
               "consensus distance 0.0" in output, output


@MULTIRANK
def test_keras_elastic_worker_added_mid_run(tmp_path):
    """2 workers, 3 from epoch 4 of 12: the newcomer builds without communicating, takes rank 0's step."""
    code, output = _keras_elastic_job(tmp_path, "localhost:2", 2, 2, 3, "localhost:3", 12, 4)
    assert code == 0, output
    for rank in (0, 1, 2):
        assert f"rank {rank}: sizes " in output and "finished at step 24 in a world of 3" in output, output
    assert output.count("sizes [2, 3], finished at step 24 in a world of 3") == 2, output
    assert output.count("sizes [3], finished at step 24 in a world of 3") == 1, output


@MULTIRANK
def test_keras_elastic_stale_step_fails_clearly(tmp_path):
    """With Horovod's own KerasState the step traced for 3 workers is not retraced: it must stop, with the reason."""
    code, output = _keras_elastic_job(tmp_path, "localhost:3", 3, 2, 3, "localhost:2", 12, 4, "--state", "horovod",
                                      timeout=200)
    assert code != 0, output
    assert "the stale step stopped with hvd_dssync's error" in output, output
