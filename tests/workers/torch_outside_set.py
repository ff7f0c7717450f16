"""One rank of a job where every rank builds an optimizer restricted to the even ranks' process set
(Horovod's ``test_optimizer_process_sets`` recipe); past 4 ranks the set's DS-Sync groups are registered
by every rank together when the optimizer is built.

As with ``hvd.DistributedOptimizer``: the even ranks train together (their models stay equal), the odd ranks
build the optimizer too, send nothing and train alone (their models differ). A bad argument raises the same
error on every rank, members or not. Every check raises on failure, so a failing rank fails the launch.
"""
import common
import horovod.torch as hvd
import hvd_dssync.torch as dss
import torch
from common import check, check_alike

hvd.init()
RANK, SIZE = common.identify(hvd)
even_set, _, mine = common.even_and_odd_sets(hvd)

# A bad argument: the same error on members and non-members, before anything is sent.
try:
    dss.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                             named_parameters=torch.nn.Linear(2, 2).named_parameters(), process_set=even_set)
    raise AssertionError("unnamed parameters were accepted")
except ValueError as error:
    message = str(error)
messages = hvd.allgather_object(message, name="test.outside.error")
check_alike(messages, f"errors differ between ranks: {messages}")
check("named_parameters" in message, f"the error does not name named_parameters: {message}")

torch.manual_seed(RANK)
model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                               named_parameters=model.named_parameters(), model=model, process_set=even_set)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(16, 10), torch.randn(16, 4)
for _ in range(3 if SIZE <= 4 else 12):  # past 4 ranks the set's DS-Sync groups average too
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
check(opt.process_set is even_set, "the optimizer does not report its process set")

if mine is even_set and even_set.size() > 2:
    dss.synchronize_models(model, process_set=even_set)  # groups of the set: equal after an exact average
weights = model[2].weight.detach().reshape(-1)
everyone = hvd.allgather(weights.unsqueeze(0), process_set=mine, name="test.outside.weights")
common.check_outside_weights(everyone, weights, mine, even_set, torch.allclose)

# The ranks outside trained alone and sent nothing, as with Horovod, so a global op after training is named
# (Horovod names an unnamed op by how many ops this process issued).
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="test.outside.after")
check(total.item() == SIZE, f"unnamed allreduce gave {total.item()}")
print(f"rank {RANK}: all checks passed", flush=True)
