"""Launch real multi-process Horovod jobs from pytest, with a timeout and every rank's output on failure.

Two launchers, named in test ids:
- ``gloo``: ``horovodrun -np N -H localhost:N --gloo`` (Horovod's rendezvous, Gloo controller and ops);
- ``mpi``: ``mpirun -np N`` with Horovod's MPI controller and MPI operations.

Ranks outnumber the 2 cores of CI, so MPI runs with settings that do not busy-wait (Open MPI yields
when idle) and single-threaded math libraries.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

LAUNCHERS = ("gloo", "mpi")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")

# Settings for more ranks than cores; the README's FAQ says why each matters.
QUIET_ENV = {
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl": "self,tcp",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "HOROVOD_GLOO_IFACE": "lo",
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}


class JobFailed(AssertionError):
    pass


def command(launcher, np, argv):
    """The launch command line for ``argv`` (a Python script and its arguments) on ``np`` ranks."""
    bin_dir = os.path.dirname(sys.executable)
    if launcher == "gloo":
        return [os.path.join(bin_dir, "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
                sys.executable, *argv]
    if launcher == "mpi":
        mpirun = shutil.which("mpirun")
        return [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np),
                "-x", "HOROVOD_CONTROLLER=mpi", "-x", "HOROVOD_CPU_OPERATIONS=mpi",
                *[a for k in QUIET_ENV for a in ("-x", k)], "-x", "PATH", "-x", "PYTHONPATH",
                "-x", "HVD_DSSYNC_TEST_LAUNCHER",
                sys.executable, *argv]
    raise ValueError(f"unknown launcher {launcher!r}; use one of {LAUNCHERS}")


def job_env(launcher, extra=None):
    env = dict(os.environ)
    env.update(QUIET_ENV)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["HVD_DSSYNC_TEST_LAUNCHER"] = launcher
    if launcher == "mpi":
        env.update(HOROVOD_CONTROLLER="mpi", HOROVOD_CPU_OPERATIONS="mpi")
    env.update(extra or {})
    return env


def kill_session(session_id):
    """Kill every process of the job's session: mpirun puts its ranks in process groups of their own."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id:  # after the name: state, ppid, pgrp, session
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run(launcher, np, script, *args, timeout=240, env=None, expect_failure=False):
    """Run ``tests/workers/<script>`` on ``np`` ranks once; return its combined output.

    Fails the test (with all ranks' output) on a non-zero exit, or on a hang past ``timeout`` seconds,
    after killing the whole process group. With ``expect_failure`` a zero exit fails instead. Gloo jobs run
    with horovodrun's own Gloo timeout, as users run them; a job is never run again: a flaky job fails.
    """
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    cmd = command(launcher, np, [path, *map(str, args)])
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=job_env(launcher, env), cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        output, _ = proc.communicate()
        raise JobFailed(f"{launcher} job {script} on {np} ranks hung past {timeout}s"
                        f"{_failed_behaviours(output)}; output:\n{output}")
    finally:
        kill_session(proc.pid)
    elapsed = time.monotonic() - started
    if expect_failure:
        if proc.returncode == 0:
            raise JobFailed(f"{launcher} job {script} on {np} ranks should have failed; output:\n{output}")
    elif proc.returncode != 0:
        raise JobFailed(f"{launcher} job {script} on {np} ranks exited {proc.returncode} after "
                        f"{elapsed:.1f}s{_failed_behaviours(output)}; output:\n{output}")
    return output


def _failed_behaviours(output):
    """``: failed behaviours: ...`` from the workers' ``BEHAVIOUR FAILED:`` lines (tests/workers/common.py)."""
    failed = sorted({line.split("BEHAVIOUR FAILED:", 1)[1].split(" (rank")[0].strip()
                     for line in output.splitlines() if "BEHAVIOUR FAILED:" in line})
    return f": failed behaviours: {'; '.join(failed)}" if failed else ""


def matrix(sizes=(2, 3, 4), both=(), wide=()):
    """Parameters for ``@pytest.mark.parametrize("launcher,np", matrix())`` with readable ids: every size
    under each launcher. ``make test`` runs each size under one launcher, the two taking turns (and both at
    each size in ``both``, neither at each size in ``wide``), so that every launcher is covered; the other
    pairs are marked ``wide`` (``make test-wide``): the launcher changes how Horovod negotiates and moves the
    bytes, not what the adapters compute, and CI's time is bounded.

    Example::

        >>> [(p.id, bool(p.marks)) for p in matrix((2, 3))]
        [('gloo-np2', False), ('mpi-np2', True), ('gloo-np3', True), ('mpi-np3', False)]
        >>> [p.id for p in matrix((2, 3, 4), wide=(4,)) if not p.marks]
        ['gloo-np2', 'mpi-np3']
    """
    return [pytest.param(launcher, np, id=f"{launcher}-np{np}",
                         marks=() if np not in wide and (launcher == LAUNCHERS[i % 2] or np in both)
                         else pytest.mark.wide)
            for i, np in enumerate(sizes) for launcher in LAUNCHERS]


def crossed(named, launchers=LAUNCHERS):
    """Parameters for ``@pytest.mark.parametrize("launcher,value", crossed({"torch": ..., "keras": ...}))``:
    every launcher (of ``launchers``) with every value, ids ``launcher-name``. As in :func:`matrix`, ``make test`` runs each
    value under one launcher, the two taking turns; the other pairs are ``wide``.

    Example::

        >>> [(p.id, bool(p.marks)) for p in crossed({"torch": 1, "keras": 2})]
        [('gloo-torch', False), ('mpi-torch', True), ('gloo-keras', True), ('mpi-keras', False)]
    """
    return [pytest.param(launcher, value, id=f"{launcher}-{name}",
                         marks=() if launcher == launchers[i % len(launchers)] else pytest.mark.wide)
            for i, (name, value) in enumerate(named.items()) for launcher in launchers]
