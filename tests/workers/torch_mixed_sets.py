"""One rank of an 8-rank job whose ranks build the DS-Sync optimizer with different process sets (ranks 0-3
with the even ranks' set, ranks 4-7 with the odd ranks'): the groups inside a set cannot be registered
together, and every rank raises the same error naming which ranks built it alike."""
import common
import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch
from common import check, check_alike

hvd.init()
RANK, SIZE = common.identify(hvd)
check(SIZE == 8, "the job runs on 8 ranks")
even_set, odd_set, _ = common.even_and_odd_sets(hvd)
model = torch.nn.Linear(4, 2)
try:
    dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                             process_set=even_set if RANK < 4 else odd_set)
    raise AssertionError("ranks building with different process sets were accepted")
except RuntimeError as error:
    message = str(error)
messages = hvd.allgather_object(message, name="test.mixed.error")
check_alike(messages, f"errors differ between ranks: {messages}")
check("ranks [0, 1, 2, 3]; ranks [4, 5, 6, 7]" in message, f"the error does not say which ranks differ: {message}")
print(f"rank {RANK}: all checks passed", flush=True)
