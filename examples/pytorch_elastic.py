"""Elastic Horovod with DS-Sync: train an MLP on scikit-learn's digits while workers come and go.

Horovod's elastic recipe, unchanged but for the optimizer: the state holds the model and DS-Sync's
optimizer (``hvd.elastic.TorchState``), ``hvd.elastic.run`` restarts the training function after a
worker joins or leaves, and DS-Sync's optimizer rebuilds its groups for the new world at its next step
(it notices the re-initialized Horovod, drops the old process sets, and continues from rank 0's step).

Run with a host discovery script that prints the hosts available now, one ``host:slots`` a line::

    printf '#!/bin/sh\\necho localhost:2\\n' > discover_hosts.sh && chmod +x discover_hosts.sh
    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover_hosts.sh \\
        --network-interface lo python examples/pytorch_elastic.py

(``--network-interface lo`` for a job on one machine; name the hosts' interface across machines.)

Edit what the script prints (``localhost:3``, ``localhost:1``) while it trains to add or remove a
worker. The optimizer rebuilds the shuffle (the default) and butterfly schedules for a new world; keep
to them under elastic Horovod.
"""
import argparse

import horovod.torch as hvd
import hvd_dssync.torch as dss  # import before hvd.init(): it lets plain hvd.init() allow process sets
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the world size")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0)
    x_train, y_train = torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train)
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    # The only DS-Sync line: groups of 2 ranks, capped at the world size when the world shrinks.
    opt = dss.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), model=model,
                                   group_size=2, seed=args.seed)

    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)

    def on_reset():
        # The world changed: scale the learning rate to the new size (the data shard follows hvd.rank()).
        for group in opt.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            # This rank's shard of the epoch's permutation, for the world as it is now.
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(state.epoch))
            shard = order[hvd.rank()::hvd.size()]
            batches = len(shard) // args.batch_size
            while state.batch < batches:
                idx = shard[state.batch * args.batch_size:(state.batch + 1) * args.batch_size]
                opt.zero_grad()
                F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                opt.step()
                state.batch += 1
                if state.batch % 10 == 0:
                    state.commit()  # a point to restore after a failure; also where new workers join
            if hvd.rank() == 0:
                with torch.no_grad():
                    accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
                print(f"epoch {state.epoch + 1}: {hvd.size()} workers, rank 0's accuracy {accuracy:.1%}",
                      flush=True)
            state.batch = 0
            state.epoch += 1
            state.commit()

    train(state)
    dss.synchronize_models(model)  # every rank ends with the exact average of all models
    distance = dss.consensus_distance(model)  # a collective: every rank calls it
    if hvd.rank() == 0:
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        print(f"averaged model: test accuracy {accuracy:.1%}, consensus distance {distance:.1f}", flush=True)


if __name__ == "__main__":
    main()
