"""The bench's accuracy curves, from snapshots of every rank's model taken off the training clock.

Each rank keeps a copy of its model every ``snapshot_every`` steps (:class:`Snapshots`; the copies stay in
memory during training and are written once, after it) with the training clock at that step. After the job,
the bench evaluates, for every snapshot, rank 0's model and the consensus model (the mean of all ranks'
models: what a final exact average would give) on the task's test set, here in the bench's own process, so
that no rank computes or waits for an evaluation while the contenders train. Two tasks:

- ``synthetic`` (the default): 10 classes, 64 features, 25,000 samples drawn once by scikit-learn's
  ``make_classification`` (two clusters a class, ``class_sep`` 2.5), 5,000 of them the test set: one test
  sample is 0.02 pp. The bench's MLP reaches 95% in about 110 steps of 128 samples, 97% in about 190.
- ``digits``: scikit-learn's 8x8 digits, 360 test images (one is 0.28 pp); 95% in about 55 steps.

Which samples are tested is drawn from the run's seed; the data set itself is the same for every seed.
"""
import os
import time

import numpy as np

from .catalog import build_model, higher_target

__all__ = ["TASKS", "load_data", "Snapshots", "snapshot_every", "curves", "attach_curves", "SNAPSHOT_BUDGET_BYTES"]

TASKS = ("synthetic", "digits")
SNAPSHOT_BUDGET_BYTES = 256 * 2**20  # a rank's snapshots, at most


def load_data(seed, task="synthetic"):
    """``(x_train, y_train, x_test, y_test)`` of ``task``, float32 features and int64 labels; the test set is
    drawn from ``seed``.

    Example::

        >>> x, y, xt, yt = load_data(0)
        >>> x.shape, xt.shape, sorted(set(yt.tolist())) == list(range(10))
        ((20000, 64), (5000, 64), True)
    """
    if task == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int64)
        test_size = 360
    elif task == "synthetic":
        from sklearn.datasets import make_classification

        x, y = make_classification(n_samples=25000, n_features=64, n_informative=40, n_redundant=8, n_classes=10,
                                   n_clusters_per_class=2, class_sep=2.5, flip_y=0.0, random_state=1234)
        x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
        y = y.astype(np.int64)
        test_size = 5000
    else:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")
    order = np.random.default_rng(seed).permutation(len(y))
    test, train = order[:test_size], order[test_size:]
    return x[train], y[train], x[test], y[test]


def snapshot_every(parameters, steps, eval_every, budget=SNAPSHOT_BUDGET_BYTES):
    """``(every, dtype)``: snapshot every ``eval_every`` steps in float32 where ``steps`` of them fit
    ``budget`` bytes, else in float16; where even those do not fit, every odd number of steps the budget
    allows, the fewest. Odd, so that the copies of a run fall at every place of an averaging period of a
    power of two steps (4, 8, 16, 32): an even spacing reads a period at the same places in every run, right
    after a waited average or never.

    Example::

        >>> snapshot_every(300_000, 400, 2)
        (2, 'float32')
        >>> snapshot_every(6_000_000, 400, 2, budget=2**30)
        (5, 'float16')
        >>> snapshot_every(6_000_000, 400, 6, budget=2**30)
        (6, 'float16')
    """
    def fits(every, size):
        return (steps // every + 1) * parameters * size <= budget

    if fits(eval_every, 4):
        return eval_every, "float32"
    if fits(eval_every, 2):
        return eval_every, "float16"
    every = eval_every + 1 + eval_every % 2  # the first odd number past it
    while every <= steps and not fits(every, 2):
        every += 2
    return every, "float16"


class Snapshots:
    """One rank's model copies with the training clock at each, written to ``path`` after training.

    A copy taken while an average runs behind the steps (``overlap``) is read as evaluating the model then would
    have read it: an evaluation folds the average in first, waiting for it. So :meth:`fold` (the optimizer's
    fold hook) adds what the fold moved to every copy taken while that average was in flight, and :meth:`stamp`,
    after the step that folded it, notes the training seconds from the copy until then: its delay, when that
    reading was there to be had (the end of the folding step: no sooner than an evaluation would have had it).

    Example::

        snapshots = Snapshots(model, every=2, dtype="float32")
        opt.register_fold_hook(snapshots.fold)          # where the optimizer may overlap its averages
        ...
        opt.step()
        snapshots.stamp(train_clock)                    # after each step
        snapshots.take(step + 1, train_clock, opt.in_flight)   # off the clock, on the steps it asks for
        snapshots.write(f"{out}.rank{rank}.npz")
    """

    def __init__(self, model, every, dtype):
        self.model, self.every, self.dtype = model, every, dtype
        self.steps, self.times, self.delays, self.copies = [], [], [], []
        self._awaiting, self._folded = [], []  # copies whose average is in flight; folded, not yet stamped
        self.seconds = 0.0  # spent in fold, to be kept off the training clock

    def due(self, step):
        return step % self.every == 0

    def take(self, step, clock, in_flight=False):
        """A copy of the model at ``step`` and training time ``clock``; ``in_flight``: an average runs behind the
        steps (the copy is corrected where it is folded in)."""
        import torch

        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        self.copies.append(flat.numpy().astype(self.dtype))
        self.steps.append(step)
        self.times.append(clock)
        self.delays.append(0.0)
        if in_flight:
            self._awaiting.append(len(self.copies) - 1)

    def fold(self, moves):
        """The optimizer's fold hook: ``moves``, ``(name, tensor)`` of what the fold added to the model (the
        parameters' names of ``model.named_parameters()``), added to each copy taken while it was in flight.
        Its seconds are bookkeeping, kept off the training clock as :meth:`take`'s are (:attr:`seconds`)."""
        if not self._awaiting:
            return
        import torch

        started = time.perf_counter()
        by_name = dict(moves)
        with torch.no_grad():
            flat = torch.cat([by_name[name].detach().reshape(-1).float() if name in by_name
                              else torch.zeros(p.numel()) for name, p in self.model.named_parameters()])
            for k in self._awaiting:
                copy = torch.from_numpy(self.copies[k])  # the same memory: corrected in place
                copy.copy_(copy.float().add_(flat))
        self._folded += self._awaiting
        self._awaiting = []
        self.seconds += time.perf_counter() - started

    def stamp(self, clock):
        """After a step, at training time ``clock``: the copies corrected during it were to be had from then."""
        for k in self._folded:
            self.delays[k] = clock - self.times[k]
        self._folded = []

    def write(self, path):
        np.savez(path, steps=np.array(self.steps), times=np.array(self.times), delays=np.array(self.delays),
                 copies=np.stack(self.copies) if self.copies else np.zeros((0, 0), self.dtype))


def _accuracy(model, flat, x, y):
    import torch

    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(flat.astype(np.float32)), model.parameters())
        return (model(x).argmax(1) == y).float().mean().item()


def curves(paths, model, x_test, y_test, targets=(0.95, 0.97), thin_after=5):
    """Rank 0's and the consensus model's test accuracy at every snapshot of the ranks' files ``paths``
    (rank 0's first), as the record's curve: ``[{"step", "time", "accuracy", "accuracy_time",
    "consensus_accuracy", "consensus_accuracy_time"}]``. ``time`` is rank 0's training clock at the copy;
    ``accuracy_time`` when rank 0's reading was to be had (later where an average in flight was folded into the
    copy: :class:`Snapshots`); ``consensus_accuracy_time`` when every rank's was. Once both curves have reached
    every target, only every ``thin_after``-th snapshot is evaluated (and the last). The files are removed.
    """
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))  # the bench's own process; no job runs now
    loaded = [np.load(path) for path in paths]
    try:
        steps, times = loaded[0]["steps"], loaded[0]["times"]
        copies = [f["copies"] for f in loaded]
        delays = [f["delays"] if "delays" in f.files else np.zeros(len(f["steps"])) for f in loaded]
        count = min(len(c) for c in copies)
        x, y = torch.from_numpy(x_test), torch.from_numpy(y_test)
        out, reached = [], False
        for k in range(count):
            if reached and k % thin_after and k != count - 1:
                continue
            rank0 = _accuracy(model, copies[0][k], x, y)
            mean = np.mean([c[k].astype(np.float32) for c in copies], axis=0)
            consensus = _accuracy(model, mean, x, y)
            out.append({"step": int(steps[k]), "time": float(times[k]), "accuracy": rank0,
                        "accuracy_time": float(times[k] + delays[0][k]), "consensus_accuracy": consensus,
                        "consensus_accuracy_time": float(times[k] + max(d[k] for d in delays))})
            reached = reached or min(rank0, consensus) >= max(targets)
        return out
    finally:
        for f in loaded:
            f.close()
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


def attach_curves(record, out_path, config):
    """Replace the record's curve (rank 0's clock and training loss at each snapshot) by :func:`curves` of
    the ranks' snapshot files beside ``out_path``, keeping the training loss."""
    paths = [f"{out_path}.rank{rank}.npz" for rank in range(record["size"])]
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:
        raise FileNotFoundError(f"no snapshots from {len(missing)} rank(s), e.g. {missing[0]}")
    _, _, x_test, y_test = load_data(config["seed"], config.get("task", "synthetic"))
    model = build_model(config["hidden"], config["seed"])
    losses = {point["step"]: point.get("train_loss") for point in record["curve"]}
    record["curve"] = curves(paths, model, x_test, y_test, targets=(config["target"], higher_target(config)))
    for point in record["curve"]:
        point["train_loss"] = losses.get(point["step"])
    return record
