"""Synthetic throughput benchmark, in the style of Horovod's pytorch_synthetic_benchmark.py.

Measures the time of one training step (forward, backward, optimizer step with its synchronization) on
random data, with Horovod's optimizer or, with ``--dssync``, with DS-Sync's::

    horovodrun -np 4 -H localhost:4 python examples/pytorch_synthetic_benchmark.py
    horovodrun -np 4 -H localhost:4 python examples/pytorch_synthetic_benchmark.py --dssync --num-groups 2
"""
import argparse
import json
import timeit

import horovod.torch as hvd
import hvd_dssync.torch as dss
import numpy as np
import torch
import torch.nn.functional as F


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dssync", action="store_true", help="use DS-Sync instead of hvd.DistributedOptimizer")
    parser.add_argument("--schedule", default="shuffle", choices=("shuffle", "butterfly"))
    parser.add_argument("--num-groups", type=int, default=2, help="0: DS-Sync's default for the world size")
    parser.add_argument("--average-every", type=int, default=1, help="DS-Sync's local steps between averages")
    parser.add_argument("--overlap", action="store_true", help="DS-Sync's asynchronous averaging")
    parser.add_argument("--model", default="mlp", choices=("mlp", "resnet18"),
                        help="mlp (communication-heavy, --params sets its size) or resnet18 (compute-heavy, "
                             "11.2M parameters, 32x32 images)")
    parser.add_argument("--static", action="store_true", help="register the groups at init (dss.init)")
    parser.add_argument("--params", type=float, default=1.0, help="model size in millions of parameters")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--json", help="append the result as one JSON line to this file (rank 0)")
    return parser.parse_args()


def make_model(million_params):
    width = int((million_params * 1e6 / 2) ** 0.5)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


class BasicBlock(torch.nn.Module):
    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(outputs)
        self.conv2 = torch.nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(outputs)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                                torch.nn.BatchNorm2d(outputs))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def make_resnet18(classes=10):
    """ResNet-18 for 32x32 images (the CIFAR variant: a 3x3 stem, no max-pool), 11.2M parameters."""
    layers, inputs = [], 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
        inputs = outputs
    return torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(64),
                               torch.nn.ReLU(), *layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(512, classes))


def main():
    args = parse_args()
    schedule_args = dict(schedule=args.schedule,
                         num_groups=args.num_groups or None if args.schedule == "shuffle" else None)
    if args.static:
        dss.init(**schedule_args)
    else:
        hvd.init()
    torch.manual_seed(0)
    model = make_model(args.params) if args.model == "mlp" else make_resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.dssync:
        optimizer = dss.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), model=model,
                                             overlap=args.overlap, average_every=args.average_every, **schedule_args)
        name = f"dssync-{args.schedule}" + ("-static" if args.static else "") + ("-overlap" if args.overlap else "") \
            + (f"-every{args.average_every}" if args.average_every > 1 else "")
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        name = "horovod"
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(args.batch_size, 256) if args.model == "mlp" else torch.randn(args.batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    times = []
    for _ in range(args.num_iters):
        times.append(timeit.timeit(benchmark_step, number=args.num_batches_per_iter) / args.num_batches_per_iter)
    step_ms = 1000 * float(np.median(times))
    # Every rank's median, so the slowest rank shows.
    slowest = hvd.allreduce(torch.tensor(step_ms), op=hvd.Max, name="bench.slowest").item()
    params = sum(p.numel() for p in model.parameters())
    if hvd.rank() == 0:
        print(f"{name}: {hvd.size()} ranks, {params / 1e6:.2f}M parameters, median step {step_ms:.2f} ms "
              f"(slowest rank {slowest:.2f} ms), {args.batch_size * hvd.size() / slowest * 1000:.0f} samples/s")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"name": name, "ranks": hvd.size(), "params": params, "step_ms": step_ms,
                                    "slowest_rank_step_ms": slowest}) + "\n")


if __name__ == "__main__":
    main()
