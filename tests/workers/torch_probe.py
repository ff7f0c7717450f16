"""One rank of the topology-probe job: time the host pairs, print the racks found."""
import json

import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch

hvd.init()
topology = dss.probe_topology(nbytes=1 << 20, repeats=3)
# The probe must leave every rank's op sequence alike: an unnamed op after it would hang otherwise.
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
assert total.item() == hvd.size(), total
if hvd.rank() == 0:
    print("RACKS " + json.dumps(topology.rack_ranks()), flush=True)
