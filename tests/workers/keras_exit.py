"""Keras: groups that finish their last steps at different times, and a script that ends without a global op.

Two fixed pairs, (0, 1) and (2, 3), never average with each other, and the first pair is slower in its last
steps, so the second pair's processes reach their exit while the first still averages.
"""
import time

import hvd_dssync.keras as dss  # before hvd.init(): plain hvd.init() must allow process sets
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

STEPS = 8
hvd.init()


class SlowEnd(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if hvd.rank() < 2 and batch >= STEPS - 3:
            time.sleep(1.0)


class Pairs:
    def groups(self, step):
        return [[0, 1], [2, 3]]


model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2)])
model.compile(optimizer=dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), schedule=Pairs()), loss="mse")
x = np.random.default_rng(hvd.rank()).normal(size=(4 * STEPS, 3)).astype(np.float32)
model.fit(x, np.zeros((4 * STEPS, 2), np.float32), batch_size=4, verbose=0, callbacks=[SlowEnd()])
print(f"rank {hvd.rank()} done", flush=True)
