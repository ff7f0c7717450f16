"""One bench rank started by a real launcher: ``python -m hvd_dssync.bench.launched CONFIG_JSON``.

Fills the rank and the size from the launcher's environment (horovodrun: ``HOROVOD_RANK``,
``HOROVOD_SIZE``; mpirun: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``), then runs
:func:`hvd_dssync.bench.worker.main`.
"""
import json
import os
import sys

__all__ = ["main"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config = json.loads(argv[0])
    for key in ("rank", "size"):
        value = os.environ.get(f"HOROVOD_{key.upper()}") or os.environ.get(f"OMPI_COMM_WORLD_{key.upper()}")
        if value is None:
            raise SystemExit(f"launched: neither HOROVOD_{key.upper()} nor OMPI_COMM_WORLD_{key.upper()} is set")
        config[key] = int(value)
    from .worker import main as worker_main

    return worker_main([json.dumps(config)])


if __name__ == "__main__":
    sys.exit(main())
