"""The Keras adapter's step with its averages waited for and with ``overlap=True``, side by side.

Each job runs ``--ranks`` ranks on this machine under mpirun, a Keras MLP of about ``--hidden``^2 parameters
trained by ``model.fit``-style traced steps; every step first "computes" for ``--compute-ms`` (a sleep that
leaves the CPU free, the bench's emulated accelerator) and then averages in groups of two every
``--average-every`` steps, and over every rank every ``--global-every`` steps where given. The ways alternate,
``--runs`` jobs each; with ``--fragments N`` a third way, ``overlap=True`` with each global average in ``N``
fragments (``HVD_DSSYNC_GLOBAL_FRAGMENTS``). The figures are rank 0's mean and median step (the first 5 steps,
traced, left out), and the mean step's ratio to that of steps that only compute (``--average-every 0``: never
averaged). Run from the repository root::

    .venv/bin/python -m hvd_dssync.bench.experiments.keras_overlap --ranks 4 --runs 3

Each job runs once under a timeout; a failed job is reported and ends the experiment with exit status 1.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def rank_main(args):
    import horovod.tensorflow.keras as hvd
    import numpy as np
    import tensorflow as tf

    import hvd_dssync.keras as dss

    hvd.init()
    tf.keras.utils.set_random_seed(hvd.rank())
    model = tf.keras.Sequential([tf.keras.Input(shape=(args.hidden,)), tf.keras.layers.Dense(args.hidden),
                                 tf.keras.layers.Dense(1)])
    opt = tf.keras.optimizers.SGD(0.001)
    if args.average_every:
        opt = dss.DistributedOptimizer(opt, schedule="shuffle", group_size=2, average_every=args.average_every,
                                       global_every=args.global_every or None, overlap=args.mode != "waited", seed=0)
    x = tf.constant(np.random.default_rng(hvd.rank()).normal(size=(32, args.hidden)).astype(np.float32))
    y = tf.reduce_sum(x, axis=1, keepdims=True)

    def compute():
        time.sleep(args.compute_ms / 1000.0)
        return np.float32(0.0)

    @tf.function
    def step():
        pause = tf.numpy_function(compute, [], tf.float32, stateful=True)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2) + pause
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    if args.average_every:
        dss.synchronize_models(model)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(times[5:]), flush=True)


def run_job(args, mode, average_every):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1", HOROVOD_CONTROLLER="mpi",
               HOROVOD_CPU_OPERATIONS="mpi", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("HVD_DSSYNC_GLOBAL_FRAGMENTS", None)
    if mode == "fragments":
        env["HVD_DSSYNC_GLOBAL_FRAGMENTS"] = str(args.fragments)
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.ranks), sys.executable, "-m",
            "hvd_dssync.bench.experiments.keras_overlap", "--worker", "--mode", mode, "--hidden", str(args.hidden),
            "--compute-ms", str(args.compute_ms), "--average-every", str(average_every), "--global-every",
            str(args.global_every if average_every else 0), "--steps", str(args.steps)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024, help="MLP width: about hidden^2 parameters")
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--average-every", type=int, default=1)
    p.add_argument("--global-every", type=int, default=0, help="steps between averages over every rank (0: none)")
    p.add_argument("--fragments", type=int, default=1, help="above 1: a third way, each global average in as many")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="waited", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return rank_main(args)
    means = {"compute only": [], "waited": [], "overlap": [], **({"fragments": []} if args.fragments > 1 else {})}
    try:
        for run in range(args.runs):
            for mode in means:
                steps = run_job(args, mode, 0 if mode == "compute only" else args.average_every)
                means[mode].append(statistics.mean(steps))
                print(f"run {run}: {mode:12s} mean step {statistics.mean(steps):.3f} s, "
                      f"median {statistics.median(steps):.3f} s", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"failed: {e}", flush=True)
        return 1
    floor = statistics.median(means["compute only"])
    for mode, values in means.items():
        print(f"{mode:12s} mean step, median of {len(values)} runs: {statistics.median(values):.3f} s "
              f"({statistics.median(values) / floor:.2f}x compute only; runs {', '.join(f'{v:.3f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
