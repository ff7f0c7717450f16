"""One rank of the adaptive-policy job: global averages become slow for a while, then fast again.

The slowdown is real: rank 0 sleeps inside every global average during steps [SLOW_FROM, SLOW_TO), so
every rank waits for it there, while group averages stay fast. Every rank must switch to group averages
at the same step (PyTorch inside the window where they slow down, Keras at its end), and back once the
global averages are fast again; the decisions, the steps' kinds and the final models are gathered and
compared. Usage: adaptive.py torch|keras [exchange] (``switch_early="exchange"``, PyTorch)
"""
import logging
import sys
import time

import numpy as np

FRAMEWORK = sys.argv[1]
EXCHANGE = sys.argv[2:] == ["exchange"]
STEPS, SLOW_FROM, SLOW_TO = 64, 16, 48
# The delay dwarfs the noise of a loaded machine, where a fast average can take as long as a step's compute.
DELAY, COMPUTE = 1.0, 0.05
# Windows of 8 steps, a probe every second window: slow from window 2, fast again from window 6.
SETTINGS = dict(decide_every=8, max_period=1, probe_every=2, enter_gain=0.7, leave_gain=0.5, drift_bound=None,
                switch_early="exchange" if EXCHANGE else True)
# The first window averages in groups only; at its end the ranks gather their figures: every group average
# as fast as the others (the costliest stands in for a global one), so global averages follow. PyTorch
# switches at the global average after the first slow one (the last period's figures ride along it, and
# group averages would save far more than enter_gain), or, exchanging them before it, makes that average a
# group one; Keras at the window's end. The way back comes at the probe of the window 56-63 (under group
# averages the windows 8-15, 24-31, ... probe), whose one global average is fast again.
EXPECTED_CHANGES = {"torch": [(7, "global"), (17, "group"), (63, "global")],
                    "keras": [(7, "global"), (23, "group"), (63, "global")]}[FRAMEWORK]


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def slow_global_averages(module, global_set_id, step_of):
    """Make rank 0 sleep inside the global averages of the slow steps (``horovod.torch``: the adapter averages
    through ``grouped_allreduce_async_`` and waits for it; see hvd_dssync/torch/collectives.py)."""
    allreduce = module.grouped_allreduce_async_

    def slowed(tensors, *args, process_set=None, **kwargs):
        if module.rank() == 0 and process_set is not None and process_set.process_set_id == global_set_id \
                and SLOW_FROM <= step_of() < SLOW_TO:
            time.sleep(DELAY)
        return allreduce(tensors, *args, process_set=process_set, **kwargs)

    module.grouped_allreduce_async_ = slowed


def check(decisions, figures, kinds, models, messages, hvd, allgather_object):
    every = allgather_object((decisions, kinds))
    assert all(e == every[0] for e in every), f"ranks disagree: {every}"
    changes, mode = [], "group"
    for step, decided, period in decisions:
        if decided != mode:
            changes.append((step, decided))
            mode = decided
    assert changes == EXPECTED_CHANGES, f"mode changes {changes}, expected {EXPECTED_CHANGES}; {figures}"
    assert all(k == "group" for k in kinds[24:31]) and kinds[32:40].count("group") == 8, kinds
    assert kinds[:8] == ["group"] * 8, kinds  # the first window: no global average
    assert "group" not in kinds[8:16], kinds  # global averages do not probe
    if FRAMEWORK == "torch":  # the slow global averages: the one that measured, and the one that carried it
        assert kinds[16:19] == ["global", "group", "group"] if EXCHANGE else ["global", "global", "group"], kinds
    assert sum(1 for m in messages if "averages every" in m) == 3, messages
    spread = float(np.max(np.ptp(np.stack(allgather_object(models)), axis=0)))
    assert spread == 0.0, f"models differ by {spread} after global averages"
    print(f"rank {hvd.rank()}: changes {changes}; all checks passed", flush=True)


def run_torch():
    import horovod.torch as hvd
    import hvd_dssync.torch as dss
    import torch
    from hvd_dssync.adaptive import AdaptivePolicy

    hvd.init()
    torch.manual_seed(hvd.rank())
    for bad, message in ((dict(policy="sometimes"), "Arg ``policy``"),
                         (dict(policy="adaptive", global_every=4), "Arg ``global_every``")):
        try:
            dss.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), **bad)
        except ValueError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"{bad} accepted")
    model = torch.nn.Linear(64, 8)
    opt = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model,
                                   named_parameters=model.named_parameters(), schedule="butterfly",
                                   policy=AdaptivePolicy(**SETTINGS))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    slow_global_averages(hvd, hvd.global_process_set.process_set_id, lambda: opt.sync_step)
    counter = Count()
    logging.getLogger("hvd_dssync.adaptive").addHandler(counter)
    logging.getLogger("hvd_dssync.adaptive").setLevel(logging.INFO)
    decisions, figures, kinds, saved = [], [], [], None
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.randn(16, 64)).pow(2).mean().backward()
        time.sleep(COMPUTE)
        opt.step()
        kinds.append(opt.last_sync["kind"])
        decision = opt.last_sync.get("decision")
        if decision is not None:
            assert decision["step"] == step, decision
            decisions.append((step, decision["mode"], decision["period"]))
            figures.append({k: round(v, 3) if isinstance(v, float) else v for k, v in decision.items()})
            if "inside a window" in decision["reason"]:  # an early switch reads the last period's costs only
                assert np.isnan(decision["drift"]), decision
            elif "group" in kinds[-8:-1]:  # a window's decision: measured by its group averages themselves
                assert np.isfinite(decision["drift"]), decision
        if step == 31:
            saved = opt.state_dict()
    model_now = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    check(decisions, figures, kinds, model_now, counter.messages, hvd, hvd.allgather_object)
    # Horovod's resume recipe: rank 0 alone loads the checkpoint; at the first step every rank takes its
    # step and the decision in force, and continues with group averages where the saved run was.
    resumed = dss.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model,
                                       named_parameters=model.named_parameters(), schedule="butterfly",
                                       policy=AdaptivePolicy(**SETTINGS))
    if hvd.rank() == 0:
        resumed.load_state_dict(saved)
        assert resumed._plan.adaptive.state() == saved["dssync"]["adaptive"], saved["dssync"]
    model(torch.randn(16, 64)).pow(2).mean().backward()
    resumed.step()
    mine = (resumed.sync_step, resumed.last_sync["kind"], resumed._plan.adaptive.averages,
            resumed._plan.adaptive.decision.mode)
    every = hvd.allgather_object(mine)
    expected = (33, "group", saved["dssync"]["adaptive"]["averages"] + 1, "group")
    assert every == [expected] * hvd.size(), every
    print(f"rank {hvd.rank()}: resumed alike", flush=True)


def run_keras():
    import horovod.tensorflow.keras as hvd
    import horovod.tensorflow as hvd_tf
    import hvd_dssync.keras as dss
    import tensorflow as tf
    from hvd_dssync.adaptive import AdaptivePolicy

    hvd.init()
    tf.random.set_seed(hvd.rank())
    try:
        dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), policy="adaptive", global_every=2)
    except ValueError as e:
        assert "Arg ``global_every``" in str(e), e
    else:
        raise AssertionError("global_every accepted with policy='adaptive'")
    steps = [0]
    original = hvd_tf.grouped_allreduce

    def slowed(tensors, *args, process_set=None, **kwargs):
        """In the traced step: rank 0 sleeps inside the global averages of the slow steps."""
        if hvd.rank() == 0 and process_set is not None and process_set.process_set_id == 0:
            def sleep():
                if SLOW_FROM <= steps[0] < SLOW_TO:
                    time.sleep(DELAY)
                return np.float32(0)
            with tf.control_dependencies([tf.numpy_function(sleep, [], tf.float32)]):
                tensors = [tf.identity(t) for t in tensors]
        return original(tensors, *args, process_set=process_set, **kwargs)

    hvd_tf.grouped_allreduce = slowed
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(8)])
    opt = dss.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), schedule="butterfly",
                                   policy=AdaptivePolicy(**SETTINGS))
    model.compile(optimizer=opt, loss="mse")
    counter = Count()
    logging.getLogger("hvd_dssync.adaptive").addHandler(counter)
    logging.getLogger("hvd_dssync.adaptive").setLevel(logging.INFO)
    kinds = []

    class Compute(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            steps[0] = opt.sync_step
            kinds.append(opt._dssync.plan.adaptive.action(opt.sync_step))
            time.sleep(COMPUTE)

    rows = STEPS // 4 * 16  # 4 epochs of 16 steps
    x, y = np.random.randn(rows, 64).astype("float32"), np.random.randn(rows, 8).astype("float32")
    history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Compute(),
                                   dss.callbacks.SyncStatsCallback()])
    decisions = [(d["step"], d["mode"], d["period"]) for d in opt.dssync_decisions]
    figures = [{k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()} for d in opt.dssync_decisions]
    model_now = np.concatenate([v.numpy().ravel() for v in model.variables])
    check(decisions, figures, kinds, model_now, counter.messages, hvd, hvd_tf.allgather_object)
    assert history.history["dssync_global_averaging"] == [1.0, 0.0, 0.0, 1.0], history.history
    # Under group averages only a probe window (one in two here) ends with a global average and decides.
    assert history.history["dssync_decision_step"] == [15.0, 31.0, 47.0, 63.0], history.history


if __name__ == "__main__":
    {"torch": run_torch, "keras": run_keras}[FRAMEWORK]()
