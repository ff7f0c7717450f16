"""An emulated cluster on one Linux machine: one network namespace per host, one bridge per rack.

A host holds ``slots_per_host`` ranks (1 by default: one rank per namespace); ``h0``, ``h1``... below are
hosts, and ranks are numbered host by host.

Layout (``RUN`` is a per-run id such as ``dss3fa2``, so concurrent runs never touch each other)::

    namespace RUN-h0 (eth0 10.77.0.10) --veth RUN-v0-- bridge RUN-br0 --RUN-up0==RUN-up1-- bridge RUN-br1 ...
    namespace RUN-h1 (eth0 10.77.0.11) --veth RUN-v1--/                                  \\-- RUN-v4 -- RUN-h4

Every host's own link (``eth0`` inside its namespace) is shaped to the intra-rack rate, and the links
between racks (``RUN-up*``, one veth pair per neighbouring pair of racks, both ends in the root
namespace and attached to the two bridges) to the inter-rack rate, with optional added delay. The
bridges carry no address: nothing in the root namespace can reach a rank or be reached by one, and the
namespaces have no default route, so traffic stays on loopback and inside the namespaces made here.

Bytes over the bottleneck are read from the ``tx_bytes`` counters of the inter-rack veths.

Everything is torn down by :meth:`Testbed.close` (also at interpreter exit, on SIGTERM and Ctrl-C); a run
records its pid in ``/run/hvd_dssync-testbed/RUN.pid`` so that the next run removes what a killed run
left behind, and only that.
"""
import atexit
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import uuid

__all__ = ["Testbed", "namespaces_available", "cleanup_stale", "kill_namespace_processes", "STATE_DIR"]

STATE_DIR = "/run/hvd_dssync-testbed"
SUBNET = ipaddress.ip_network("10.77.0.0/24")
FIRST_HOST = 10
_RUN_ID = re.compile(r"^dss[0-9a-f]{4}$")
_COMMAND_TIMEOUT = 20


def _ip(*args, check=True):
    return _run(["ip", *args], check=check)


def _run(cmd, check=True):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=_COMMAND_TIMEOUT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"testbed: `{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces_available():
    """``(True, "")`` where this process may create network namespaces and shape links, else ``(False, why)``."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "not root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed"
    probe = f"dssprobe{uuid.uuid4().hex[:4]}"  # not a run id: no cleanup touches it
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return False, f"`ip netns add` is not allowed here: {made.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "dssp0", "type", "veth", "peer", "name", "dssp1", check=False)
        if veth.returncode != 0:
            return False, f"veth pairs are not allowed here: {veth.stderr.strip()}"
        return True, ""
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{type(e).__name__}: {e}"
    finally:
        _ip("netns", "del", probe, check=False)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(ns):
    """SIGKILL every process in network namespace ``ns`` (what a run left behind there)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_run(run_id):
    """Remove every namespace, link and hosts file of run ``run_id``; idempotent."""
    prefix = f"{run_id}-"
    for ns in _ip("netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(prefix):
            kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.split("\n"):
        match = re.match(r"^\d+:\s+([^:@]+)", line)
        if match and match.group(1).startswith(prefix):
            _ip("link", "del", match.group(1), check=False)
    if os.path.isdir("/etc/netns"):
        for name in os.listdir("/etc/netns"):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
    try:
        os.unlink(os.path.join(STATE_DIR, f"{run_id}.pid"))
    except FileNotFoundError:
        pass


def _kill_process_groups(procs):
    """SIGKILL the process group of every process still running, then reap them (bounded waits)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def cleanup_stale():
    """Remove testbeds whose owning process is gone (a killed run); return their run ids."""
    owners = {}
    if os.path.isdir(STATE_DIR):
        for name in os.listdir(STATE_DIR):
            run_id = name[:-4]
            if name.endswith(".pid") and _RUN_ID.match(run_id):
                try:
                    with open(os.path.join(STATE_DIR, name)) as f:
                        owners[run_id] = int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    owners[run_id] = -1
    seen = set(owners)
    for line in _ip("netns", "list", check=False).stdout.split("\n"):
        run_id = line.split("-")[0]
        if _RUN_ID.match(run_id):
            seen.add(run_id)
    for line in _ip("-o", "link", "show", check=False).stdout.split("\n"):
        match = re.match(r"^\d+:\s+(dss[0-9a-f]{4})-", line)
        if match:
            seen.add(match.group(1))
    stale = sorted(r for r in seen if not (owners.get(r, -1) > 0 and _pid_alive(owners[r])))
    # A run that is still creating its testbed writes its pid file first, so a run id without a pid
    # file belongs to no live run.
    for run_id in stale:
        _remove_run(run_id)
    return stale


class Testbed:
    """Racks of emulated hosts; ``with Testbed(racks=[2, 2]) as tb: tb.popen(rank, argv, env)``.

    Args:
        racks: ranks per rack, e.g. ``[4, 4]``; ranks are numbered rack by rack.
        slots_per_host: ranks per host (one namespace); every rack's rank count must be a multiple.
        intra_mbit: rate of every host's own link (Mbit/s); 0 leaves it unshaped.
        inter_mbit: rate of each link between racks (Mbit/s, each direction); 0 leaves it unshaped.
        delay_ms: added one-way delay on the links between racks.

    Example::

        from hvd_dssync.bench.contenders import run_contender

        with Testbed(racks=[2, 2], intra_mbit=200, inter_mbit=20) as tb:
            before = tb.bottleneck_bytes()
            record = run_contender(tb, "dssync-topology", config, timeout=120)
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, racks, intra_mbit=0.0, inter_mbit=0.0, delay_ms=0.0, slots_per_host=1):
        if not racks or any(int(n) < 1 for n in racks):
            raise ValueError(f"Arg ``racks`` must list positive rank counts, got {racks!r}.")
        if sum(racks) > 200:
            raise ValueError("Arg ``racks``: at most 200 ranks fit the testbed's /24 subnet.")
        if intra_mbit < 0 or inter_mbit < 0 or delay_ms < 0:
            raise ValueError("Rates and delay must be non-negative.")
        self.slots_per_host = int(slots_per_host)
        if self.slots_per_host < 1 or any(int(n) % self.slots_per_host for n in racks):
            raise ValueError(f"Arg ``slots_per_host`` ({slots_per_host!r}) must be positive and divide every "
                             f"rack's rank count {list(racks)!r}.")
        self.racks = [int(n) for n in racks]
        self.size = sum(self.racks)
        self.host_count = self.size // self.slots_per_host
        self.intra_mbit = float(intra_mbit)
        self.inter_mbit = float(inter_mbit)
        self.delay_ms = float(delay_ms)
        self.run_id = f"dss{uuid.uuid4().hex[:4]}"
        self.rack_of = [k for k, n in enumerate(self.racks) for _ in range(n)]
        self.host_rack = [self.rack_of[h * self.slots_per_host] for h in range(self.host_count)]
        self.bottleneck_links = []  # (name, from rack, to rack): the egress of each inter-rack veth end
        self._procs = []
        self._closed = True
        self._previous_handlers = {}

    # --- naming ----------------------------------------------------------------------------

    def namespace(self, rank):
        """The namespace of ``rank``'s host."""
        return self.host_namespace(rank // self.slots_per_host)

    def address(self, rank):
        """The address of ``rank``'s host."""
        return self.host_address(rank // self.slots_per_host)

    def host_namespace(self, host):
        return f"{self.run_id}-h{host}"

    def host_address(self, host):
        return str(SUBNET.network_address + FIRST_HOST + host)

    @property
    def hostname(self):
        return socket.gethostname()

    def hosts_arg(self):
        """Horovod's and Open MPI's ``-H`` value: ``10.77.0.10:2,10.77.0.11:2`` (address:slots per host)."""
        return ",".join(f"{self.host_address(h)}:{self.slots_per_host}" for h in range(self.host_count))

    def host_map(self):
        """``{address or namespace name: namespace}`` of every host: the remote shell's map."""
        out = {}
        for h in range(self.host_count):
            out[self.host_address(h)] = out[self.host_namespace(h)] = self.host_namespace(h)
        return out

    def rack_ranks(self):
        out, start = [], 0
        for n in self.racks:
            out.append(list(range(start, start + n)))
            start += n
        return out

    # --- life cycle ------------------------------------------------------------------------

    def __enter__(self):
        self.create()
        return self

    def __exit__(self, *exc):
        self.close()

    def create(self):
        cleanup_stale()
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(os.path.join(STATE_DIR, f"{self.run_id}.pid"), "w") as f:
            f.write(f"{os.getpid()}\n")
        self._closed = False
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            try:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: the caller's own handling and atexit remain
                pass
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _on_signal(self, signum, frame):
        self.close()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def _build(self):
        rid = self.run_id
        for k in range(len(self.racks)):
            _ip("link", "add", f"{rid}-br{k}", "type", "bridge")
            _ip("link", "set", f"{rid}-br{k}", "up")
        for host in range(self.host_count):
            ns, outside = self.host_namespace(host), f"{rid}-v{host}"
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                # ip netns exec bind-mounts this over /etc/hosts: the hostname resolves to this
                # namespace's own address, not loopback, so Gloo finds the right interface without
                # HOROVOD_GLOO_IFACE too.
                # The namespace's name is its hostname where a launcher starts a host's processes in a UTS
                # namespace of their own (hvd_dssync.bench.remote_shell).
                f.write(f"127.0.0.1 localhost\n{self.host_address(host)} {self.hostname} {ns}\n")
                for other in range(self.host_count):
                    if other != host:
                        f.write(f"{self.host_address(other)} {self.host_namespace(other)}\n")
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outside, "master", f"{rid}-br{self.host_rack[host]}", "up")
            _ip("-n", ns, "addr", "add", f"{self.host_address(host)}/{SUBNET.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.intra_mbit:
                self._tbf(["ip", "netns", "exec", ns], "eth0", self.intra_mbit, 0.0, "add")
        # A chain of racks: rack k and k+1 joined by one veth pair (two racks: one bottleneck link).
        for k in range(len(self.racks) - 1):
            a, b = f"{rid}-up{k}a", f"{rid}-up{k}b"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "master", f"{rid}-br{k}", "up")
            _ip("link", "set", b, "master", f"{rid}-br{k + 1}", "up")
            self.bottleneck_links += [(a, k, k + 1), (b, k + 1, k)]
        for name, _, _ in self.bottleneck_links:
            if self.inter_mbit or self.delay_ms:
                self._tbf([], name, self.inter_mbit, self.delay_ms, "add")
        self._wait_until_reachable()

    @staticmethod
    def _tbf(prefix, dev, mbit, delay_ms, verb):
        """Shape ``dev``'s egress: token bucket at ``mbit`` Mbit/s (0: none), then ``delay_ms`` of delay."""
        if mbit:
            # A burst of ~2 ms of traffic (at least 32 KB) keeps tbf accurate at these rates.
            burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.002))
            _run([*prefix, "tc", "qdisc", verb, "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{mbit}mbit",
                  "burst", str(burst), "latency", "200ms"])
            if delay_ms and verb == "add":
                _run([*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                      "delay", f"{delay_ms}ms", "limit", "10000"])
        elif delay_ms:
            _run([*prefix, "tc", "qdisc", verb, "dev", dev, "root", "handle", "1:", "netem", "delay",
                  f"{delay_ms}ms", "limit", "10000"])

    def set_inter_rate(self, mbit):
        """Change the rate of every link between racks now (dynamic contention)."""
        if not mbit:
            raise ValueError("Arg ``mbit`` must be positive.")
        for name, _, _ in self.bottleneck_links:
            self._tbf([], name, mbit, 0.0, "change" if self.inter_mbit else "replace")
        self.inter_mbit = float(mbit)

    def set_host_rate(self, mbit):
        """Change the rate of every host's own link now (a scenario with faster or slower hosts)."""
        if not mbit:
            raise ValueError("Arg ``mbit`` must be positive.")
        for host in range(self.host_count):
            self._tbf(["ip", "netns", "exec", self.host_namespace(host)], "eth0", mbit, 0.0,
                      "change" if self.intra_mbit else "replace")
        self.intra_mbit = float(mbit)

    def _wait_until_reachable(self, timeout=10.0):
        """One TCP connection from the first rank to the last, across every rack (no ping needed)."""
        import sys

        last = self.size - 1
        listener = ("import socket; s = socket.socket(); s.bind((%r, 5999)); s.listen(); s.settimeout(%r); "
                    "s.accept()[0].recv(1)" % (self.address(last), timeout))
        client = ("import socket, time\nend = time.monotonic() + %r\nwhile True:\n"
                  "    try:\n        socket.create_connection((%r, 5999), timeout=1).send(b'x'); break\n"
                  "    except OSError:\n"
                  "        if time.monotonic() > end: raise\n        time.sleep(0.1)\n" % (timeout, self.address(last)))
        server = subprocess.Popen(["ip", "netns", "exec", self.namespace(last), sys.executable, "-c", listener],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            probe = subprocess.run(["ip", "netns", "exec", self.namespace(0), sys.executable, "-c", client],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout + 5)
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            probe = None
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        if probe is None or probe.returncode != 0:
            raise RuntimeError(f"testbed: {self.namespace(last)} is unreachable from {self.namespace(0)} "
                               f"within {timeout:.0f}s")

    def close(self):
        """Kill the ranks still running and remove everything this testbed made; idempotent."""
        if self._closed:
            return
        self._closed = True
        _kill_process_groups(self._procs)
        _remove_run(self.run_id)
        for sig, handler in self._previous_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, TypeError):
                pass
        self._previous_handlers = {}
        atexit.unregister(self.close)

    # --- running ranks ---------------------------------------------------------------------

    def popen(self, rank, argv, env, **kwargs):
        """Start ``argv`` inside ``rank``'s namespace in its own process group (killed by :meth:`close`)."""
        if self._closed:
            raise RuntimeError("testbed: create() it first")
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(rank), *argv], env=env,
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def bottleneck_bytes(self):
        """``{link: tx_bytes}`` of every inter-rack veth end (what crossed a bottleneck, per direction)."""
        out = {}
        for name, _, _ in self.bottleneck_links:
            with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
                out[name] = int(f.read())
        return out

    def describe(self):
        return {"mode": "namespaces", "run_id": self.run_id, "racks": self.rack_ranks(),
                "intra_mbit": self.intra_mbit, "inter_mbit": self.inter_mbit, "delay_ms": self.delay_ms,
                "addresses": [self.address(r) for r in range(self.size)],
                "slots_per_host": self.slots_per_host,
                "hosts": [self.host_address(h) for h in range(self.host_count)],
                "bottleneck_links": [n for n, _, _ in self.bottleneck_links]}


class LoopbackBed:
    """The same interface on loopback, unshaped: where network namespaces are not allowed."""

    def __init__(self, racks, **_ignored):
        self.racks = [int(n) for n in racks]
        self.size = sum(self.racks)
        self.rack_of = [k for k, n in enumerate(self.racks) for _ in range(n)]
        self.bottleneck_links = []
        self.inter_mbit = self.intra_mbit = self.delay_ms = 0.0
        self._procs = []

    rack_ranks = Testbed.rack_ranks

    def __enter__(self):
        atexit.register(self.close)
        return self

    def __exit__(self, *exc):
        self.close()

    def address(self, rank):
        return "127.0.0.1"

    def popen(self, rank, argv, env, **kwargs):
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def set_inter_rate(self, mbit):
        pass

    def set_host_rate(self, mbit):
        pass

    def bottleneck_bytes(self):
        return {}

    def close(self):
        _kill_process_groups(self._procs)
        self._procs = []
        atexit.unregister(self.close)

    def describe(self):
        return {"mode": "loopback", "racks": self.rack_ranks(), "intra_mbit": 0.0, "inter_mbit": 0.0,
                "delay_ms": 0.0, "addresses": ["127.0.0.1"] * self.size, "bottleneck_links": []}
