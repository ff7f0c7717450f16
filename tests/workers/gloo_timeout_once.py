"""For tests/test_multirank.py: rank 0 exits as a Horovod Gloo background-loop timeout would, the first time
a marker file is absent; with ``hang`` every rank sleeps instead, past the harness's timeout."""
import os
import sys
import time

from common import launcher_rank

marker = sys.argv[1]
rank = launcher_rank()
if sys.argv[2:] == ["hang"]:
    time.sleep(600)
if rank == "0" and not os.path.exists(marker):
    open(marker, "w").close()
    sys.stderr.write("[0]: Horovod background loop uncaught exception: [gloo/transport/tcp/unbound_buffer.cc:81] "
                     "Timed out waiting 30000ms for recv operation to complete\n")
    sys.exit(134)
print(f"rank {rank}: ran", flush=True)
