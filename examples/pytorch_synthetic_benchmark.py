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
    parser.add_argument("--num-groups", type=int, default=2)
    parser.add_argument("--overlap", action="store_true", help="DS-Sync's asynchronous averaging")
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


def main():
    args = parse_args()
    schedule_args = dict(schedule=args.schedule, num_groups=args.num_groups if args.schedule == "shuffle" else None)
    if args.static:
        dss.init(**schedule_args)
    else:
        hvd.init()
    torch.manual_seed(0)
    model = make_model(args.params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.dssync:
        optimizer = dss.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), model=model,
                                             overlap=args.overlap, **schedule_args)
        name = f"dssync-{args.schedule}" + ("-static" if args.static else "") + ("-overlap" if args.overlap else "")
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        name = "horovod"
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(args.batch_size, 256)
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
