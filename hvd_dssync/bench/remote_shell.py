"""An ``ssh`` for the emulated hosts: run a command on host ADDRESS = inside that host's network namespace.

Launchers reach remote hosts through a remote shell: horovodrun calls ``ssh [options] HOST COMMAND`` for
every host that is not local, and Open MPI's mpirun calls its ``plm_rsh_agent`` (``ssh`` by default) as
``AGENT [options] HOST COMMAND...`` to start its daemon on each host. This program takes the same
arguments, looks HOST up in a map of ``{address or name: namespace}`` and runs COMMAND there::

    ip netns exec NAMESPACE unshare --uts sh -c 'hostname NAMESPACE; COMMAND'

The UTS namespace gives each emulated host a hostname of its own (the testbed's hosts file maps it to the
host's address), as on a cluster. The environment is the caller's, as with ``ssh`` plus
``SendEnv``; launchers pass what the ranks need on the command line anyway (horovodrun: ``env K=V ...``,
mpirun: ``-x``). :func:`write_agent` writes the executable wrapper the launchers are pointed at.

Usage: ``python -m hvd_dssync.bench.remote_shell --map MAP.json [ssh options] HOST COMMAND...``
"""
import json
import os
import shlex
import shutil
import stat
import sys

__all__ = ["write_agent", "parse_ssh_args", "main"]

# ssh options that take a value (``-o Key=Value``, ``-p PORT`` ...); every other option is a flag.
_WITH_VALUE = set("bcDEeFIiJLlmOoPpQRSWw")


def parse_ssh_args(args):
    """``(host, command)`` from ssh-like arguments; options before the host are skipped."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        opt = args[i]
        if len(opt) == 2 and opt[1] in _WITH_VALUE:
            i += 2  # ``-o Key=Value``
        else:
            i += 1  # ``-x``, ``-oKey=Value``, ``-p22``
    if i < len(args) and args[i] == "--":
        i += 1
    if i >= len(args):
        raise ValueError(f"remote_shell: no host in {args!r}")
    host = args[i]
    rest = args[i + 1:]
    # horovodrun puts ``-p PORT`` / ``-i FILE`` / ``-o ConnectTimeout=N`` after the host.
    while rest and rest[0].startswith("-") and len(rest[0]) == 2 and rest[0][1] in _WITH_VALUE and len(rest) > 1:
        rest = rest[2:]
    if "@" in host:
        host = host.split("@", 1)[1]
    return host, " ".join(rest)


def write_agent(directory, hosts):
    """Write ``MAP.json`` and an executable ``ssh`` into ``directory``; return the wrapper's path.

    ``hosts``: ``{address or name: namespace}``. Put ``directory`` first on PATH for horovodrun, or pass
    the path to mpirun as ``--mca plm_rsh_agent PATH``.
    """
    os.makedirs(directory, exist_ok=True)
    map_path = os.path.join(directory, "hosts.json")
    with open(map_path, "w") as f:
        json.dump(hosts, f)
    agent = os.path.join(directory, "ssh")
    with open(agent, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m hvd_dssync.bench.remote_shell "
                f"--map {shlex.quote(map_path)} \"$@\"\n")
    os.chmod(agent, os.stat(agent).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return agent


def host_command(namespace, command):
    """The argv that runs shell ``command`` on the host of ``namespace`` with that host's hostname."""
    script = f"hostname {shlex.quote(namespace)} && {command}" if command.strip() else f"hostname {namespace}"
    unshare = shutil.which("unshare") or "unshare"
    return ["ip", "netns", "exec", namespace, unshare, "--uts", "sh", "-c", script]


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--map":
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 255
    with open(args[1]) as f:
        hosts = json.load(f)
    try:
        host, command = parse_ssh_args(args[2:])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 255
    if host not in hosts:
        print(f"remote_shell: unknown host {host!r} (known: {', '.join(sorted(hosts))})", file=sys.stderr)
        return 255  # ssh's own code for a failed connection
    # exec: the launcher's signals (and its kill of this process) reach the remote command directly.
    cmd = host_command(hosts[host], command)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
