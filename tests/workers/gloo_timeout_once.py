"""Exits as a Horovod Gloo background-loop timeout would, the first time a marker file is absent.

For tests/test_multirank.py: the harness must run such a job once more, and only once.
"""
import os
import sys

marker = sys.argv[1]
rank = os.environ.get("HOROVOD_RANK", "0")
if rank == "0" and not os.path.exists(marker):
    open(marker, "w").close()
    sys.stderr.write("[0]: Horovod background loop uncaught exception: [gloo/transport/tcp/unbound_buffer.cc:81] "
                     "Timed out waiting 60000ms for recv operation to complete\n")
    sys.exit(134)
if rank == "0" and sys.argv[2:] == ["always"]:
    sys.stderr.write("[0]: Horovod background loop uncaught exception: [gloo/transport/tcp/unbound_buffer.cc:133] "
                     "Timed out waiting 60000ms for send operation to complete\n")
    sys.exit(134)
print(f"rank {rank}: ran", flush=True)
