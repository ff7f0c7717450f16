"""Train an MLP on scikit-learn's digits with DS-Sync or with Horovod's own optimizer.

Run with any Horovod launcher, e.g.::

    horovodrun -np 4 -H localhost:4 python examples/pytorch_digits.py
    horovodrun -np 4 -H localhost:4 python examples/pytorch_digits.py --optimizer horovod

The only DS-Sync-specific lines are the import and the ``dss.DistributedOptimizer`` call (the one-line
swap: no DS-Sync argument; ``--schedule shuffle`` or ``butterfly`` names one), plus
``dss.synchronize_models`` at the end, so every rank holds the consensus model.
"""
import argparse
import json
import sys
import time

import horovod.torch as hvd
import hvd_dssync.torch as dss
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("dssync", "horovod"), default="dssync")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the world size")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--schedule", default="default", choices=("default", "shuffle", "butterfly"),
                        help="default: the one-line swap, no DS-Sync argument (the racks are sensed)")
    parser.add_argument("--num-groups", type=int, default=2, help="for shuffle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp16", action="store_true", help="hvd.Compression.fp16 for what each optimizer sends")
    parser.add_argument("--json", help="write the result here (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    return parser.parse_args()


def load_data(seed):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=seed,
                                                        stratify=digits.target)
    return (torch.from_numpy(x_train), torch.from_numpy(y_train).long(),
            torch.from_numpy(x_test), torch.from_numpy(y_test).long())


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    shard = torch.arange(hvd.rank(), len(x_train), hvd.size())
    x_local, y_local = x_train[shard], y_train[shard]

    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    if args.optimizer == "dssync" and args.schedule == "default":  # the one-line swap
        optimizer = dss.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), model=model,
                                             compression=compression)
    elif args.optimizer == "dssync":
        optimizer = dss.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), model=model,
                                             num_groups=args.num_groups if args.schedule == "shuffle" else None,
                                             schedule=args.schedule, seed=args.seed, compression=compression)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    steps_per_epoch = len(x_local) // args.batch_size
    steps_per_epoch = int(hvd.allreduce(torch.tensor(steps_per_epoch), op=hvd.Min, name="steps").item())
    # A progress bar redraws one line; where stderr is a pipe (mpirun, horovodrun, a log file) every
    # redraw would be a line of its own, so there the epoch line below is the only progress.
    show = hvd.rank() == 0 and not args.quiet and sys.stderr.isatty()
    generator = torch.Generator().manual_seed(args.seed + hvd.rank())
    history = []
    started = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_local), generator=generator)
        losses = []
        bar = None
        if show:
            from tqdm import tqdm
            bar = tqdm(total=steps_per_epoch, desc=f"{args.optimizer} epoch {epoch + 1}/{args.epochs}",
                       leave=False, ncols=90, mininterval=0.5)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_local[batch]), y_local[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
        if bar:
            bar.close()
        # Each rank evaluates its own model; the mean over ranks is what a user would watch.
        mean_loss = hvd.allreduce(torch.tensor(float(np.mean(losses))), name="epoch.loss").item()
        mean_acc = hvd.allreduce(torch.tensor(accuracy(model, x_test, y_test)), name="epoch.acc").item()
        distance = dss.consensus_distance(model)
        history.append({"epoch": epoch + 1, "loss": mean_loss, "accuracy": mean_acc,
                        "seconds": time.perf_counter() - started})
        if hvd.rank() == 0:
            print(f"[{args.optimizer}] epoch {epoch + 1:2d}  loss {mean_loss:.4f}  test accuracy {mean_acc:.4f}  "
                  f"consensus distance {distance:.2e}", flush=True)
    if args.optimizer == "dssync":
        dss.synchronize_models(model)
    wall = time.perf_counter() - started
    final = accuracy(model, x_test, y_test)
    if hvd.rank() == 0:
        result = {"optimizer": args.optimizer, "ranks": hvd.size(), "epochs": args.epochs,
                  "steps": steps_per_epoch * args.epochs, "wall_seconds": wall, "final_accuracy": final,
                  "history": history}
        print(f"[{args.optimizer}] {hvd.size()} ranks, {args.epochs} epochs: {wall:.1f} s, "
              f"final test accuracy {final:.4f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
