"""One rank of a job of one rank per emulated host: the Keras swap's trial of overlap (hvd_dssync.overlap) on the
racks it sensed, their period the default's: it probes first whether the racks' averages hide at half of it
(hvd_dssync.rhythm), then, where they did not, runs the trial of both ways, decides alike on every rank (at its first
look or at its last step), and whichever way it decides, the averages keep the mean of the ranks' models exactly.

Each rank's gradient is a constant of its own (``rank + 1``), so after ``synchronize_models`` every rank must
hold the mean of what each rank computed, whatever the trial chose. The trial runs four times: the probe's answer
forced to no (the period as built back at its end: the table of branches switched between two steps), its decision
forced on, then off, then the racks' averages off and the global ones in fragments (the way a trial ends is
timing's; each must fold in what is in flight exactly: off, the next waited average folds in the last overlapped
one first), then as measured; every rank prints the last. The first two halve the racks' period again from the
next period (forced), in flight then waited.
"""
import re
import types

import horovod.tensorflow.keras as hvd
import hvd_dssync.keras as dss
import numpy as np
import tensorflow as tf
from hvd_dssync.overlap import OverlapTrial
import hvd_dssync.rhythm
from hvd_dssync.rhythm import HidingProbe

hvd.init()
hvd_dssync.rhythm.HIDING_RING_STEPS = float("inf")  # the probe of the racks' period runs whatever the ring took
LR = 0.125  # a power of two: float32 sums stay exact
decide, probe_decides = OverlapTrial.decide, HidingProbe.decide


def train(forced, fragments=None, quickened=False):
    def decided(trial, gathered, early=False):
        decide(trial, gathered, early)
        if forced is not None:  # forced: no early end; the forced way at the last step
            trial.decided, trial.early = (None, False) if early else (forced, False)
            trial.racks_every = None if early or not quickened else trial.period // 2
            trial.average_every = trial.racks_every or trial.period
            if not early and fragments is not None:
                trial.global_fragments = fragments
        return trial.decided

    OverlapTrial.decide = decided
    # Forced: the probe of whether the racks' averages hide at half their period says no (the period as built
    # comes back at its end, the trial after it); as measured, what it finds.
    HidingProbe.decide = probe_decides if forced is None else lambda probe, folds: None
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(1, use_bias=False,
                                                                                   kernel_initializer="zeros")])
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(LR), model=model)
    model.compile(optimizer=opt, loss="mse")
    kernel = model.trainable_variables[0]
    gradient = tf.fill(kernel.shape, float(hvd.rank() + 1))

    @tf.function
    def step():
        opt.apply_gradients([(gradient, kernel)])

    kinds = types.SimpleNamespace(policy=opt.policy, schedule=opt.schedule,
                                  action=lambda t: types.SimpleNamespace(kind=opt.policy.action(t)))
    trial = OverlapTrial.of(kinds, choose_globals=True, quickens=True)  # its steps
    last, every = trial.last, opt.policy.average_every
    steps = last + (opt.policy.period() if quickened else 0) + 2 * every + 1  # past a switch, two periods on
    for k in range(steps):
        assert opt.overlap is None or k > (min(trial.hiding.step, trial.look) if forced is None else last), \
            (k, opt.overlap)
        step()
        if forced is not None and k == trial.hiding.end + 3:
            # The period as built came back after the probe: a local step here (at half of it, a rack's average).
            models = np.reshape(hvd.allgather(tf.reshape(kernel, [1, -1]), name="test_back"), [hvd.size(), -1])
            group = opt.schedule.group_of(hvd.rank(), opt.policy.schedule_step(k))
            assert opt.policy.action(k) == "local" and not np.array_equal(models[group[0]], models[group[1]]), k
        if quickened and forced is False and k > last and opt.policy.average_every < every and \
                k == opt.policy.since[0] + 3:
            # The traced step follows the new rhythm: a rack's average, waited for, at the new period's first one
            # (the old rhythm's step there is local, where the rack's models differ).
            models = np.reshape(hvd.allgather(tf.reshape(kernel, [1, -1]), name="test_models"), [hvd.size(), -1])
            assert opt.policy.action(k) == "group" and opt.policy.since[1].action(k) == "local", k
            group = opt.schedule.group_of(hvd.rank(), opt.policy.schedule_step(k))
            assert len(group) == 2 and np.array_equal(models[group[0]], models[group[1]]), (k, group, models)
    if quickened:  # every rank halved the racks' period at the same step, from the cycle after the decision
        assert opt.policy.average_every == every // 2 and last + 1 < opt.policy.since[0] <= last + 1 + every, \
            (opt.policy.average_every, opt.policy.since[0], last, opt.overlap_trial)
    assert opt.overlap in (True, False) and (forced is None or opt.overlap is (forced or bool(fragments))), \
        (forced, opt.overlap)
    assert not fragments or f"in flight, in {fragments} fragments" in opt.overlap_trial, opt.overlap_trial
    # Its overlapped half ran whole: the racks' averages it sent in flight were told to the trial as they were folded.
    assert forced is None or re.search(r"; the others folded in [\d.]+ steps? late(: the racks every \d+ steps from "
                                       r"the next period)?\)$", opt.overlap_trial), opt.overlap_trial
    said = ("overlap on (", "overlap on, the global averages' fragments only (") if opt.overlap else ("overlap off (",)
    assert forced is not None or opt.overlap_trial.startswith(said), opt.overlap_trial
    dss.synchronize_models(model)
    want = -LR * steps * sum(r + 1 for r in range(hvd.size())) / hvd.size()
    got = kernel.numpy().reshape(-1)
    assert np.allclose(got, want, atol=1e-5), (forced, got.tolist(), want)
    return opt.overlap, last, steps


for forced, fragments, quickened in ((True, None, True), (False, 0, True), (False, 3, False)):
    train(forced, fragments, quickened)
decided, last, steps = train(None)
print(f"OVERLAP {decided} after {steps} steps, the trial's last {last}", flush=True)
