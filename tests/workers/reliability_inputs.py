"""One rank of the bad-input job: every bad argument raises the same clear error on every rank, before any
communication, and ranks that disagree on the configuration all raise one error naming them.

Each bad input is tried inside try/except; between them and at the end an unnamed allreduce runs, which
would hang (or fail) had any rank issued an op the others did not.
"""
import common
import horovod.torch as hvd
import hvd_dssync.torch as dss  # before hvd.init(): plain hvd.init() must allow process sets
import torch
from common import check, check_alike, fail

RANK = SIZE = None


def unnamed_op():
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
    check(total.item() == SIZE, f"unnamed allreduce gave {total.item()}")


def expect_error(label, build, *fragments, error=(ValueError, TypeError, RuntimeError)):
    """``build()`` must raise ``error`` whose message holds every fragment; every rank the same message."""
    try:
        build()
    except error as e:
        message = str(e)
    else:
        fail(f"{label}: no error raised")
    for fragment in fragments:
        check(fragment in message, f"{label}: message {message!r} lacks {fragment!r}")
    messages = hvd.allgather_object(message, name=f"test.message.{label}")
    check_alike(messages, f"{label}: ranks raised different messages {messages}")
    unnamed_op()


class Uncovering:
    """Leaves the last rank out."""

    def __init__(self, size):
        self.world_size = size

    def groups(self, step):
        return [list(range(self.world_size - 1))]


class Changing:
    """A different partition on every call: not a function of the step."""

    def __init__(self, size):
        self.world_size = size
        self.calls = 0

    def groups(self, step):
        self.calls += 1
        if self.calls % 2:
            return [list(range(self.world_size))]
        return [[r] for r in range(self.world_size)]


def optimizer(model=None, **kwargs):
    model = model or torch.nn.Linear(3, 2)
    return dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **kwargs)


def bad_inputs():
    expect_error("num_groups=-1", lambda: optimizer(num_groups=-1), "``num_groups``", "at least 1")
    expect_error("num_groups>size", lambda: optimizer(num_groups=SIZE + 1), "``num_groups``",
                 f"at most the world size {SIZE}")
    expect_error("both sizes", lambda: optimizer(num_groups=1, group_size=1), "exactly one of ``num_groups``")
    expect_error("group_size>size", lambda: optimizer(group_size=SIZE + 1), "``group_size``",
                 f"at most the world size {SIZE}")
    expect_error("group_size=0", lambda: optimizer(group_size=0), "``group_size``", "at least 1")
    expect_error("seed float", lambda: optimizer(num_groups=1, seed=0.5), "``seed``", "integer")
    expect_error("seed str", lambda: optimizer(num_groups=1, seed="0"), "``seed``", "integer")
    expect_error("schedule name", lambda: optimizer(num_groups=1, schedule="shufle"), "``schedule``",
                 "'shufle'")
    expect_error("schedule uncovering", lambda: optimizer(schedule=Uncovering(SIZE)), "schedule.groups(0)",
                 f"leaves ranks [{SIZE - 1}] out")
    expect_error("schedule changing", lambda: optimizer(schedule=Changing(SIZE)), "different partitions",
                 "deterministic")
    expect_error("topology malformed", lambda: optimizer(schedule="topology", topology="[[0], oops"),
                 "topology spec is neither a file nor valid JSON")
    expect_error("topology unknown host", lambda: optimizer(schedule="topology", topology=[["no-such-host"]]),
                 "no-such-host")
    expect_error("topology unknown rank", lambda: optimizer(schedule="topology",
                                                            topology=[list(range(SIZE)), [SIZE + 3]]),
                 "topology")
    expect_error("adasum", lambda: optimizer(num_groups=1, op=hvd.Adasum), "``op=hvd.Adasum``")
    expect_error("backward_passes_per_step", lambda: optimizer(num_groups=1, backward_passes_per_step=0),
                 "``backward_passes_per_step``", "positive integer")
    expect_error("process_set", lambda: optimizer(num_groups=1, process_set=hvd.ProcessSet([0])), "``process_set``",
                 "not registered")
    expect_error("not an optimizer", lambda: dss.DistributedOptimizer(object(), num_groups=1), "``optimizer``")
    model = torch.nn.Linear(3, 2)
    expect_error("duplicate names", lambda: dss.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[("w", model.weight), ("w", model.bias)],
        num_groups=1), "duplicate names: w")


def disagreements():
    last = SIZE - 1
    expect_error("seed differs", lambda: optimizer(num_groups=1, seed=1 if RANK == last else 0),
                 "ranks disagree on", f"seed (rank 0 has 0, rank {last} has 1)")
    expect_error("num_groups differs", lambda: optimizer(num_groups=2 if RANK == last else 1),
                 f"num_groups (rank 0 has 1, rank {last} has 2)")
    expect_error("schedule differs", lambda: optimizer(schedule="butterfly" if RANK == last else "shuffle",
                                                       group_size=SIZE),
                 f"schedule (rank 0 has shuffle, rank {last} has butterfly)")
    odd = [r for r in range(SIZE) if r % 2]
    expect_error("shapes differ", lambda: optimizer(torch.nn.Linear(3, 2 + RANK % 2), num_groups=1),
                 "parameters (rank 0 has 2 tensors, digest", f"rank {odd[0]} has 2 tensors, digest")
    expect_error("warmup differs", lambda: optimizer(num_groups=1, warmup_steps=RANK),
                 "warmup_steps (rank 0 has 0, rank 1 has 1")
    # And agreeing ranks build it fine, with the same op count everywhere.
    optimizer(num_groups=1)
    unnamed_op()


def main():
    global RANK, SIZE
    hvd.init()
    RANK, SIZE = common.identify(hvd)
    bad_inputs()
    if SIZE > 1:
        disagreements()
    unnamed_op()
    print(f"rank {RANK}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
