"""Launch a job across the testbed's emulated hosts with the real launchers, as on a cluster.

The launcher runs inside the first host's namespace (a cluster's head node) and reaches the other hosts
through its own remote-shell setting, pointed at :mod:`hvd_dssync.bench.remote_shell`:

- ``horovodrun -np N -H 10.77.0.10:S,10.77.0.11:S --gloo --network-interface eth0 ...``, with a wrapper
  named ``ssh`` first on PATH (horovodrun calls ``ssh`` for every host that is not local);
- ``mpirun -np N -H ... --mca plm_rsh_agent WRAPPER --mca btl_tcp_if_include eth0 ...`` with Horovod's MPI
  controller and operations.

``horovod-hierarchical`` (Horovod's hierarchical allreduce on CPUs) always runs under mpirun, whatever
launcher the others run under (:func:`contender_launcher`). In Horovod 0.28.1
``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` selects only the NCCL hierarchical allreduce (GPU tensors); a CPU
job's hierarchy is its MPI's: Open MPI's coll/han, enabled with ``--mca coll_han_priority 100``, reduces
inside each host, allreduces between one rank per host and broadcasts inside each host, over the hosts
mpirun placed the ranks on. The variable is set as a user would set it, and changes nothing on CPUs.
``coll_han_use_simple_allreduce 1``: Open MPI 4.1.4's segmented HAN allreduce corrupts memory over the
TCP BTL on messages of a few hundred KB (the bench's gradients); the simple one has the same three
levels, unsegmented.

Example::

    with Testbed(racks=[2, 2], slots_per_host=2) as bed, tempfile.TemporaryDirectory() as tmp:
        argv = launch_command(bed, "horovodrun", [sys.executable, "train.py"], tmp)
        proc = bed.popen_head(argv, env=launch_env(bed, "horovodrun", tmp))
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from .contenders import COMMON_ENV, HOROVOD_CONTENDERS, ROOT, JobFailed, job_record
from .marks import MarkWatch
from .remote_shell import host_command, write_agent
from .testbed import kill_namespace_processes

__all__ = ["LAUNCHERS", "MPIRUN_ONLY", "HIERARCHICAL_MCA", "contender_launcher", "launch_command", "launch_env",
           "head_command", "run_launched_contender"]

LAUNCHERS = ("horovodrun", "mpirun")
IFACE = "eth0"
# Contenders that need ranks launched by mpirun, whatever the bench's --launcher (see the module's text).
MPIRUN_ONLY = ("horovod-hierarchical",)
# Open MPI's hierarchical collectives for those, and Horovod's own switch, set as a user would.
HIERARCHICAL_MCA = ("--mca", "coll_han_priority", "100", "--mca", "coll_han_use_simple_allreduce", "1")
HIERARCHICAL_ENV = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}

# More ranks than cores: no busy-waiting, single-threaded math (docs/faq.md).
_QUIET = {
    "OMP_NUM_THREADS": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}


def contender_launcher(contender, launcher):
    """The launcher ``contender`` runs under when the bench's ``--launcher`` is ``launcher``: mpirun for
    :data:`MPIRUN_ONLY`, ``launcher`` for every other one."""
    return "mpirun" if contender in MPIRUN_ONLY else launcher


def launch_env(bed, launcher, agent_dir, base=None, hierarchical=False):
    """The launcher's environment: the remote shell first on PATH, Gloo on the hosts' interface;
    ``hierarchical``: Horovod's hierarchical allreduce switched on (mpirun only)."""
    env = dict(os.environ if base is None else base)
    env.update(_QUIET)
    env["PATH"] = os.pathsep.join([agent_dir, os.path.dirname(sys.executable), env.get("PATH", "")])
    env["HOROVOD_GLOO_IFACE"] = IFACE
    for key in [k for k in env if k.startswith("OMPI_MCA_") and k.endswith("_if_include")]:
        del env[key]  # a loopback-only setting from single-host jobs would keep the hosts apart
    if launcher == "mpirun":
        env.update(HOROVOD_CONTROLLER="mpi", HOROVOD_CPU_OPERATIONS="mpi")
    if hierarchical:
        env.update(HIERARCHICAL_ENV)
    return env


def launch_command(bed, launcher, argv, agent_dir, extra_env_names=(), hierarchical=False):
    """The launcher's argv for ``argv`` on every rank of ``bed``; writes the remote shell into ``agent_dir``.

    ``hierarchical``: Open MPI's hierarchical collectives (:data:`HIERARCHICAL_MCA`) and Horovod's switch
    for them; mpirun only (a :class:`ValueError` otherwise).
    """
    if hierarchical and launcher != "mpirun":
        raise ValueError(f"the hierarchical allreduce on CPUs is Open MPI's: launch with mpirun, not {launcher!r}")
    agent = write_agent(agent_dir, bed.host_map())
    hosts = bed.hosts_arg()
    if launcher == "horovodrun":
        return [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(bed.size), "-H", hosts,
                "--gloo", "--network-interface", IFACE, *argv]
    if launcher == "mpirun":
        exported = ["HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_IFACE", "PATH", "PYTHONPATH",
                    *_QUIET, *extra_env_names, *(HIERARCHICAL_ENV if hierarchical else ()),
                    *sorted(k for k in os.environ if k.startswith("HOROVOD_"))]  # the user's Horovod settings
        exported = list(dict.fromkeys(exported))
        return [shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "-np", str(bed.size), "-H", hosts,
                "--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
                "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", IFACE,
                "--mca", "oob_tcp_if_include", IFACE, *(HIERARCHICAL_MCA if hierarchical else ()),
                *[a for k in exported for a in ("-x", k)], *argv]
    raise ValueError(f"unknown launcher {launcher!r}; use one of {LAUNCHERS}")


def head_command(bed, argv):
    """``argv`` run on the first host (the head node), with that host's hostname."""
    import shlex

    return host_command(bed.host_namespace(0), "exec " + " ".join(shlex.quote(a) for a in argv))


def run_launched_contender(bed, launcher, contender, config, timeout, rate_changes=(), log=print):
    """:func:`hvd_dssync.bench.contenders.run_contender` through ``launcher`` (horovodrun or mpirun) from the
    first host: the same record, with the link counters read at rank 0's ``MARK`` lines and the launcher in
    ``record["launcher"]``. A contender of :data:`MPIRUN_ONLY` needs ``launcher="mpirun"``
    (:func:`contender_launcher`)."""
    if contender not in HOROVOD_CONTENDERS:
        raise JobFailed(f"{contender}: not a Horovod job; {launcher} launches only {', '.join(HOROVOD_CONTENDERS)}")
    if contender in MPIRUN_ONLY and launcher != "mpirun":
        raise JobFailed(f"{contender}: runs only under mpirun, not {launcher}")
    hierarchical = contender in MPIRUN_ONLY
    workdir = tempfile.mkdtemp(prefix="hvd_dssync-bench-")
    out_path = os.path.join(workdir, "record.json")
    cfg = dict(config, contender=contender, out=out_path, hang_seconds=max(5, int(timeout) - 15))
    agent_dir = os.path.join(workdir, "agent")
    argv = head_command(bed, launch_command(bed, launcher, [sys.executable, "-m", "hvd_dssync.bench.launched",
                                                            json.dumps(cfg)], agent_dir, extra_env_names=COMMON_ENV,
                                                 hierarchical=hierarchical))
    env = launch_env(bed, launcher, agent_dir, hierarchical=hierarchical)
    env.update(COMMON_ENV)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    watch_marks, lines = MarkWatch(bed, rate_changes, log), []
    original_rate = bed.inter_mbit

    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def watch():
        for line in proc.stdout:
            lines.append(line)
            if "MARK " in line:  # horovodrun prefixes "[0]<stdout>:"
                what = line.split("MARK ", 1)[1].split()[0]
                watch_marks.note(what)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        try:
            code = proc.wait(timeout=timeout)
            failed = None if code == 0 else f"{launcher} exited {code}"
        except subprocess.TimeoutExpired:
            failed = f"timed out after {timeout:.0f}s"
        watcher.join(timeout=5)
        record = job_record(failed, f"{contender} ({launcher})", lambda: "".join(lines[-30:]), out_path, config,
                            watch_marks, rate_changes, lines)
        record["launcher"] = launcher
        return record
    finally:
        watch_marks.stop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        # The ranks on the other hosts are in their own sessions: kill what is left in every host.
        for host in range(bed.host_count):
            kill_namespace_processes(bed.host_namespace(host))
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if bed.inter_mbit != original_rate:
            bed.set_inter_rate(original_rate)
        shutil.rmtree(workdir, ignore_errors=True)
