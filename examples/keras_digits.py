"""Train an MLP on scikit-learn's digits with Keras, with DS-Sync and with Horovod's own optimizer.

Run with any Horovod launcher, e.g.::

    horovodrun -np 4 -H localhost:4 python examples/keras_digits.py

It trains the same model twice from the same initial weights and data order, first with Horovod's
``DistributedOptimizer`` and then with DS-Sync's, showing the Keras progress bar (with the consensus
distance) on rank 0, one line per epoch where the output is not a terminal, and ends with the comparison. ``--optimizer dssync`` or ``horovod`` runs one only.
The only DS-Sync-specific lines are the ``dss.DistributedOptimizer`` call (the one-line swap: no DS-Sync
argument; ``--schedule shuffle`` or ``butterfly`` names one) and its two callbacks.
"""
import argparse
import json
import sys
import time

import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss  # before hvd.init(): DS-Sync registers Horovod process sets
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("both", "dssync", "horovod"), default="both")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the world size")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--schedule", default="default", choices=("default", "shuffle", "butterfly"),
                        help="default: the one-line swap, no DS-Sync argument (the racks are sensed)")
    parser.add_argument("--group-size", type=int, default=2, help="ranks per group (at most), for shuffle")
    parser.add_argument("--overlap", action="store_true", help="DS-Sync's averages behind the next steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser.parse_args()


def load_data(seed):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)


def build_model(args):
    tf.keras.utils.set_random_seed(args.seed)  # the same initial weights for both runs and all ranks
    return tf.keras.Sequential([tf.keras.Input(shape=(64,)),
                                tf.keras.layers.Dense(args.hidden, activation="relu"),
                                tf.keras.layers.Dense(args.hidden, activation="relu"),
                                tf.keras.layers.Dense(10)])


def train(name, args, data):
    x_local, y_local, x_test, y_test = data
    model = build_model(args)
    optimizer = tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    overlap = {"overlap": True} if args.overlap else {}
    if name == "dssync" and args.schedule == "default":
        optimizer = dss.DistributedOptimizer(optimizer, **overlap)  # the one-line swap
    elif name == "dssync":
        groups = {"group_size": min(args.group_size, hvd.size())} if args.schedule == "shuffle" else {}
        optimizer = dss.DistributedOptimizer(optimizer, schedule=args.schedule, seed=args.seed, **groups, **overlap)
    if name == "dssync":
        callbacks += [dss.callbacks.ConsensusDistanceCallback(), dss.callbacks.SynchronizeModelsCallback()]
    else:
        optimizer = hvd.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Keras's progress bar redraws one line; where stdout is a pipe (mpirun, horovodrun, a log file)
    # every redraw would be a line of its own, so there it prints one line per epoch.
    verbose = 0 if hvd.rank() != 0 or args.quiet else 1 if sys.stdout.isatty() else 2
    if verbose:
        print(f"--- {name} ---", flush=True)
    tf.keras.utils.set_random_seed(args.seed + hvd.rank())  # each rank its own batch order, both runs alike
    started = time.perf_counter()
    history = model.fit(x_local, y_local, batch_size=args.batch_size, epochs=args.epochs, verbose=verbose,
                        callbacks=callbacks)
    wall = time.perf_counter() - started
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    accuracy = float(hvd.allreduce(accuracy, name=f"{name}.accuracy"))  # each rank's own model, averaged
    return {"optimizer": name, "ranks": hvd.size(), "epochs": args.epochs, "wall_seconds": wall,
            "final_accuracy": accuracy,
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}


def main():
    args = parse_args()
    hvd.init()
    x_train, x_test, y_train, y_test = load_data(args.seed)
    shard = np.arange(hvd.rank(), len(x_train), hvd.size())
    data = (x_train[shard], y_train[shard], x_test, y_test)
    names = ("horovod", "dssync") if args.optimizer == "both" else (args.optimizer,)
    results = {name: train(name, args, data) for name in names}
    if hvd.rank() == 0:
        for result in results.values():
            print(f"[{result['optimizer']}] {result['ranks']} ranks, {result['epochs']} epochs: "
                  f"{result['wall_seconds']:.1f} s, final test accuracy {result['final_accuracy']:.4f}", flush=True)
        if len(results) == 2:
            gap = results["dssync"]["final_accuracy"] - results["horovod"]["final_accuracy"]
            print(f"DS-Sync minus Horovod: {100 * gap:+.2f} percentage points of test accuracy", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
