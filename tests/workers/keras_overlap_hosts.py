"""One rank of a job of one rank per emulated host: the Keras swap's trial of overlap (hvd_dssync.overlap) runs
after its first averaging period, decides alike on every rank (at its first look or at its last step), and
whichever way it decides, the averages keep the mean of the ranks' models exactly.

Each rank's gradient is a constant of its own (``rank + 1``), so after ``synchronize_models`` every rank must
hold the mean of what each rank computed, whatever the trial chose. The trial runs four times: its decision
forced on, then off, then the racks' averages off and the global ones in fragments (the way a trial ends is
timing's; each must fold in what is in flight exactly: off, the next waited average folds in the last overlapped
one first), then as measured; every rank prints the last.
"""
import re

import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss
import numpy as np
import tensorflow as tf
from hvd_dssync.overlap import OverlapTrial

hvd.init()
LR = 0.125  # a power of two: float32 sums stay exact
decide = OverlapTrial.decide


def train(forced, fragments=None):
    def decided(trial, gathered, early=False):
        decide(trial, gathered, early)
        if forced is not None:  # forced: no early end; the forced way at the last step
            trial.decided, trial.early = (None, False) if early else (forced, False)
            if not early and fragments is not None:
                trial.global_fragments = fragments
        return trial.decided

    OverlapTrial.decide = decided
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(1, use_bias=False,
                                                                                   kernel_initializer="zeros")])
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(LR), model=model)
    model.compile(optimizer=opt, loss="mse")
    kernel = model.trainable_variables[0]
    gradient = tf.fill(kernel.shape, float(hvd.rank() + 1))

    @tf.function
    def step():
        opt.apply_gradients([(gradient, kernel)])

    trial = OverlapTrial.of(opt)
    last = trial.last
    steps = last + 2 * opt.policy.average_every + 1
    for k in range(steps):
        assert opt.overlap is None or k > (trial.look if forced is None else last), (k, opt.overlap)
        step()
    assert opt.overlap in (True, False) and (forced is None or opt.overlap is (forced or bool(fragments))), \
        (forced, opt.overlap)
    assert not fragments or f"in flight, in {fragments} fragments" in opt.overlap_trial, opt.overlap_trial
    # Its overlapped half ran whole: the racks' averages it sent in flight were told to the trial as they were folded.
    assert forced is None or re.search(r"; the others folded in [\d.]+ steps? late\)$", opt.overlap_trial), \
        opt.overlap_trial
    said = ("overlap on (", "overlap on, the global averages' fragments only (") if opt.overlap else ("overlap off (",)
    assert forced is not None or opt.overlap_trial.startswith(said), opt.overlap_trial
    dss.synchronize_models(model)
    want = -LR * steps * sum(r + 1 for r in range(hvd.size())) / hvd.size()
    got = kernel.numpy().reshape(-1)
    assert np.allclose(got, want, atol=1e-5), (forced, got.tolist(), want)
    return opt.overlap, last, steps


for forced, fragments in ((True, None), (False, 0), (False, 3)):
    train(forced, fragments)
decided, last, steps = train(None)
print(f"OVERLAP {decided} after {steps} steps, the trial's last {last}", flush=True)
