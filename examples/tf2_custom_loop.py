"""DS-Sync in a TF2 custom training loop: the replacement for ``hvd.DistributedGradientTape``.

Run with any Horovod launcher, e.g.::

    horovodrun -np 4 -H localhost:4 python examples/tf2_custom_loop.py

With Horovod, a custom loop wraps its tape in ``hvd.DistributedGradientTape`` to average gradients.
With DS-Sync the tape stays a plain ``tf.GradientTape`` (each rank steps on its own gradient) and a
``dss.ModelAverager`` averages the model inside the step's group after the update. The whole step is
one ``tf.function``: the averager picks the group from its step counter in the graph.
"""
import argparse

import horovod.tensorflow as hvd
import hvd_dssync.keras as dss  # before hvd.init(): DS-Sync registers Horovod process sets
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=10)
    args = parser.parse_args()

    hvd.init()
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split((digits.data / 16.0).astype(np.float32), digits.target,
                                                        test_size=0.25, random_state=0, stratify=digits.target)
    shard = np.arange(hvd.rank(), len(x_train), hvd.size())
    # Every rank must run the same number of steps (each step is a collective): the smallest shard's.
    steps = (len(x_train) // hvd.size()) // args.batch_size
    dataset = (tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard]))
               .shuffle(1024, seed=hvd.rank()).batch(args.batch_size, drop_remainder=True).take(steps))

    model = tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(128, activation="relu"),
                                 tf.keras.layers.BatchNormalization(momentum=0.9), tf.keras.layers.Dense(10)])
    optimizer = tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    averager = dss.ModelAverager(group_size=min(2, hvd.size()), seed=0, warmup_steps=args.warmup_steps)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = averager.gradients(tape.gradient(loss, model.trainable_variables))  # warm-up: allreduced
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        averager(model.variables)  # the model, BatchNorm statistics included, averaged in the step's group
        return loss

    hvd.broadcast_variables(model.variables, root_rank=0)
    for epoch in range(args.epochs):
        for x, y in dataset:
            loss = train_step(x, y)
        distance = dss.consensus_distance(model)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {float(loss):.4f}  consensus distance {distance:.2e}  "
                  f"step {int(averager.step.numpy())}", flush=True)
    dss.synchronize_models(model)
    accuracy = np.mean(np.argmax(model(x_test, training=False), axis=1) == y_test)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks: test accuracy of the consensus model {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
