"""Horovod's Gloo rendezvous server for a job that no ``horovodrun`` launches.

``python -m hvd_dssync.bench.rendezvous HOST:SLOTS[,HOST:SLOTS...] [--bind ADDR] [--max-seconds S]``
binds to ``ADDR`` (any free port), initializes the server with the host allocation plan exactly as
``horovodrun --gloo`` does, prints ``PORT <n>`` and serves until its standard input closes (its parent
exited) or ``--max-seconds`` pass.
"""
import argparse
import sys
import threading

__all__ = ["main"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hvd_dssync.bench.rendezvous")
    parser.add_argument("hosts", help="HOST:SLOTS,... in rank order, as horovodrun -H")
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args(argv)

    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    hosts = parse_hosts(args.hosts)
    plan = get_host_assignments(hosts, sum(h.slots for h in hosts))
    server = RendezvousHTTPServer((args.bind, 0), RendezvousHandler, 0)
    server.init(plan)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"PORT {server.server_address[1]}", flush=True)
    closed = threading.Event()

    def wait_for_eof():
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    closed.wait(args.max_seconds)
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
