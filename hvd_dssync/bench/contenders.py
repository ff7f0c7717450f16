"""Launch one contender's job on a testbed, one rank per emulated host, and collect its record.

Horovod contenders run under the Gloo controller without ``horovodrun``: this module starts Horovod's
rendezvous server inside rank 0's namespace (:mod:`hvd_dssync.bench.rendezvous`) and gives every rank
the environment ``horovodrun --gloo`` would. PyTorch contenders use ``torch.distributed`` over Gloo with
rank 0's address as ``MASTER_ADDR``. Every rank is one emulated host (namespace); in loopback mode all
ranks are on one host. ``horovod-hierarchical`` is not started here: it needs ranks launched by mpirun
(:func:`hvd_dssync.bench.launchers.run_launched_contender`).
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from .marks import MarkWatch, cores_busy, link_bytes
from .metric import attach_curves
from .catalog import CONTENDERS, HOROVOD_BSP

__all__ = ["CONTENDERS", "HOROVOD_CONTENDERS", "run_contender", "job_record", "run_ranks", "rank_env",
           "start_rendezvous", "JobFailed"]

HOROVOD_CONTENDERS = tuple(c for c in CONTENDERS if c in HOROVOD_BSP or c.startswith("dssync-"))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Settings every rank gets, whatever the contender: one math thread per rank (ranks outnumber cores).
COMMON_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
              "HOROVOD_GLOO_TIMEOUT_SECONDS": "60", "TF_CPP_MIN_LOG_LEVEL": "2"}


class JobFailed(RuntimeError):
    pass


def rank_env(bed, rank, contender, port):
    """The environment of ``rank``: ``horovodrun --gloo``'s variables, or torch.distributed's."""
    env = dict(os.environ)
    env.update(COMMON_ENV)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    namespaces = bed.describe()["mode"] == "namespaces"
    iface = "eth0" if namespaces else "lo"
    if contender in HOROVOD_CONTENDERS:
        # One emulated host per rank in namespaces; one host holding every rank on loopback.
        if namespaces:
            host, local_rank, local_size, cross_rank, cross_size = bed.namespace(rank), 0, 1, rank, bed.size
        else:
            host, local_rank, local_size, cross_rank, cross_size = "localhost", rank, bed.size, 0, 1
        env.update({
            "HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(bed.size),
            "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
            "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": str(cross_size),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": bed.address(0), "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_GLOO_IFACE": iface, "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        })
    else:
        env.update({"MASTER_ADDR": bed.address(0), "MASTER_PORT": str(port), "RANK": str(rank),
                    "WORLD_SIZE": str(bed.size), "GLOO_SOCKET_IFNAME": iface})
    return env


def start_rendezvous(bed, deadline):
    """Horovod's rendezvous server in rank 0's namespace until ``deadline``: ``(its process, its port)``."""
    hosts = ",".join(f"{bed.namespace(r)}:1" for r in range(bed.size)) if bed.describe()["mode"] == "namespaces" \
        else f"localhost:{bed.size}"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = bed.popen(0, [sys.executable, "-m", "hvd_dssync.bench.rendezvous", hosts, "--bind", bed.address(0),
                         "--max-seconds", str(max(10, int(deadline - time.monotonic())))],
                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise JobFailed(f"the rendezvous server did not start: {line!r}")
    return proc, int(line.split()[1])


def run_ranks(bed, argv, contender, timeout, env=None, meanwhile=None):
    """Run ``argv`` as every rank of ``bed`` with ``contender``'s environment (:func:`rank_env`, Horovod's
    rendezvous started for it) and ``env``; ``meanwhile(bed)`` is called every 50 ms while they run. Returns
    every rank's ``(exit code, output)``; a rank still running after ``timeout`` seconds is killed."""
    deadline = time.monotonic() + timeout
    rendezvous, port = start_rendezvous(bed, deadline)
    procs = [bed.popen(rank, argv, env=dict(rank_env(bed, rank, contender, port), **(env or {})),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(bed.size)]
    outputs = []
    try:
        while meanwhile is not None and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            meanwhile(bed)
            time.sleep(0.05)
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0] + f"\n(killed after {timeout:g} s)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        rendezvous.stdin.close()
        rendezvous.wait(timeout=10)
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


def _free_port_hint(bed):
    # torch.distributed's store listens in rank 0's namespace: any fixed port is free there; on loopback
    # take one the kernel hands out.
    if bed.describe()["mode"] == "namespaces":
        return 29500
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_contender(bed, contender, config, timeout, rate_changes=(), log=print):
    """Run ``contender`` on every rank of ``bed``; return rank 0's record with the link counters.

    ``rate_changes=[(seconds, mbit), ...]`` sets the inter-rack rate that many seconds after training
    starts (dynamic contention), and the rate is restored afterwards. Raises :class:`JobFailed` with every
    rank's output tail when a rank fails or the job outlives ``timeout`` seconds.
    """
    if contender == "horovod-hierarchical":
        raise JobFailed(f"{contender}: runs only under mpirun (hvd_dssync.bench.launchers.run_launched_contender)")
    deadline = time.monotonic() + timeout
    workdir = tempfile.mkdtemp(prefix="hvd_dssync-bench-")
    out_path = os.path.join(workdir, "record.json")
    rendezvous = None
    procs, logs = [], []
    watch_marks = MarkWatch(bed, rate_changes, log)
    original_rate = bed.inter_mbit
    try:
        if contender in HOROVOD_CONTENDERS:
            rendezvous, port = start_rendezvous(bed, deadline)
        else:
            port = _free_port_hint(bed)
        for rank in range(bed.size):
            cfg = dict(config, contender=contender, rank=rank, size=bed.size, out=out_path,
                       hang_seconds=max(5, int(timeout) - 15))
            argv = [sys.executable, "-m", "hvd_dssync.bench.worker", json.dumps(cfg)]
            log_path = os.path.join(workdir, f"rank{rank}.log")
            logs.append(log_path)
            if rank == 0:
                procs.append(bed.popen(rank, argv, env=rank_env(bed, rank, contender, port),
                                       stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True))
            else:
                with open(log_path, "w") as f:
                    procs.append(bed.popen(rank, argv, env=rank_env(bed, rank, contender, port),
                                           stdout=f, stderr=subprocess.STDOUT))

        def watch_rank0():
            for line in procs[0].stdout:
                if line.startswith("MARK "):
                    what = line.split()[1]
                    watch_marks.note(what)

        watcher = threading.Thread(target=watch_rank0, daemon=True)
        watcher.start()
        failed = None
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"timed out after {timeout:.0f}s"
                break
            if code != 0:
                failed = f"rank {rank} exited {code}"
                break
        watcher.join(timeout=5)
        return job_record(failed, contender, lambda: _tails(logs), out_path, config, watch_marks, rate_changes,
                          _read(logs[0]).splitlines())
    finally:
        watch_marks.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if rendezvous is not None:
            rendezvous.stdin.close()
            try:
                rendezvous.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rendezvous.kill()
        if bed.inter_mbit != original_rate:
            bed.set_inter_rate(original_rate)


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def job_record(failed, what, tail, out_path, config, watch, rate_changes, lines):
    """The record rank 0 wrote at ``out_path``, with what the bench adds to it: the accuracy curves
    (:func:`hvd_dssync.bench.metric.attach_curves`), the bytes over the links and how busy this host's cores were
    between rank 0's marks (``watch``: :class:`hvd_dssync.bench.marks.MarkWatch`), the rate changes that took
    place, and the first warnings of rank 0's output ``lines``. Raises
    :class:`JobFailed` naming ``what`` with ``tail()`` where the job ``failed`` (a reason) or wrote no record."""
    if failed is None and not os.path.exists(out_path):
        failed = "rank 0 wrote no record"
    if failed:
        raise JobFailed(f"{what}: {failed}\n" + tail())
    with open(out_path) as f:
        record = json.load(f)
    attach_curves(record, out_path, config)
    record["links"] = link_bytes(watch.marks)
    record["cores_busy"] = cores_busy(watch.cpu)
    record["rate_changes"] = [{"after_seconds": seconds, "mbit": mbit}
                              for k, (seconds, mbit) in enumerate(rate_changes) if f"rate_change.{k}" in watch.marks]
    record["warnings"] = [line.strip() for line in lines if "Warning" in line][:5]
    return record


def _tails(logs, lines=15):
    return "\n".join(f"--- rank {r} ---\n" + "\n".join(_read(p).splitlines()[-lines:]) for r, p in enumerate(logs))
