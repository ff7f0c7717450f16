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

``--emulated`` (as root) runs each rank on an emulated host of its own instead, in two racks on the bench's
``accelerator`` links (``--intra-mbit`` 4000, ``--inter-mbit`` 400 Mbit/s), launched as the bench launches its
contenders, and the optimizer as the one-line swap makes it (``DistributedOptimizer(opt)``: the racks sensed,
the default rhythm; ``--average-every`` and ``--global-every`` where given): "waited" is ``overlap=False``,
"overlap" ``overlap=True``, and a fourth way, "trial", the default (``overlap=None``: its trial decides at
step 135 in the default rhythm; rank 0's log of what it chose is printed)::

    .venv/bin/python -m hvd_dssync.bench.experiments.keras_overlap --emulated --hidden 2400 --fragments 4 --runs 3

Each job runs once under a timeout; a failed job is reported and ends the experiment with exit status 1.
"""
import argparse
import contextlib
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
    overlap = {"waited": False, "trial": None}.get(args.mode, True)
    plain = opt
    if args.emulated and args.mode != "compute only":  # the swap's optimizer, its rhythm where given
        rhythm = {k: v for k, v in (("average_every", args.average_every), ("global_every", args.global_every)) if v}
        opt = dss.DistributedOptimizer(opt, overlap=overlap, **rhythm)
    elif args.average_every:
        opt = dss.DistributedOptimizer(opt, schedule="shuffle", group_size=2, average_every=args.average_every,
                                       global_every=args.global_every or None, overlap=overlap, seed=0)
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
    if opt is not plain:
        dss.synchronize_models(model)
        if hvd.rank() == 0 and args.mode == "trial":
            print(f"TRIAL {opt.overlap_trial}", flush=True)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(times[5:]), flush=True)


def run_job(args, mode, bed=None):
    """One job of ``mode``: rank 0's step times, and what its trial chose (the "trial" way; else None). On
    one host under mpirun, or on ``bed``'s emulated hosts as the bench launches its contenders."""
    every, global_every = (args.average_every or 0, args.global_every) if mode != "compute only" else (0, 0)
    fragments = {"HVD_DSSYNC_GLOBAL_FRAGMENTS": str(args.fragments) if mode == "fragments" else ""}  # "": unset
    worker = [sys.executable, "-m", "hvd_dssync.bench.experiments.keras_overlap", "--worker", "--mode", mode,
              "--hidden", str(args.hidden), "--compute-ms", str(args.compute_ms), "--average-every", str(every),
              "--global-every", str(global_every), "--steps", str(args.steps),
              *(("--emulated",) if bed is not None else ())]
    if bed is not None:
        from hvd_dssync.bench.contenders import run_ranks

        env = dict(fragments, TF_CPP_MIN_LOG_LEVEL="2")
        ranks = run_ranks(bed, worker, "dssync-default", args.timeout, env)
        code, out = ranks[0] if all(c == 0 for c, _ in ranks) else next((c, o) for c, o in ranks if c != 0)
        err = ""
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1", HOROVOD_CONTROLLER="mpi",
                   HOROVOD_CPU_OPERATIONS="mpi", TF_CPP_MIN_LOG_LEVEL="2", **fragments)
        argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.ranks)] + worker
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not lines:
        raise RuntimeError(f"{mode} job failed ({code}):\n{out[-2000:]}\n{err[-2000:]}")
    trial = next((line[len("TRIAL "):] for line in out.splitlines() if line.startswith("TRIAL ")), None)
    return json.loads(lines[-1][len("RESULT "):]), trial


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024, help="MLP width: about hidden^2 parameters")
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--average-every", type=int, default=None,
                   help="steps between averages (one host: 1; --emulated: the swap's)")
    p.add_argument("--global-every", type=int, default=0,
                   help="steps between averages over every rank (one host, 0: none; --emulated, 0: the swap's)")
    p.add_argument("--fragments", type=int, default=1, help="above 1: a third way, each global average in as many")
    p.add_argument("--steps", type=int, default=None, help="steps a job (one host: 40; --emulated: 240)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--emulated", action="store_true", help="each rank on an emulated host, two racks (root)")
    p.add_argument("--intra-mbit", type=float, default=4000.0, help="--emulated: the hosts' links")
    p.add_argument("--inter-mbit", type=float, default=400.0, help="--emulated: the link between the racks")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="waited", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 240 if args.emulated else 40
    if args.worker:
        return rank_main(args)
    if args.average_every is not None and args.average_every < 1 or args.global_every < 0:
        p.error("--average-every must be 1 or more, --global-every 0 or more")
    if args.average_every is None and not args.emulated:
        args.average_every = 1
    if args.emulated and (args.ranks < 4 or args.ranks % 2):
        p.error(f"--emulated: --ranks {args.ranks} does not split into two racks of 2 or more")
    ways = ["compute only", "waited", "overlap", *(["fragments"] if args.fragments > 1 else []),
            *(["trial"] if args.emulated else [])]
    means = {way: [] for way in ways}
    with contextlib.ExitStack() as stack:
        bed = None
        if args.emulated:
            from hvd_dssync.bench.testbed import Testbed

            bed = stack.enter_context(Testbed(racks=[args.ranks // 2] * 2, intra_mbit=args.intra_mbit,
                                              inter_mbit=args.inter_mbit))
        try:
            for run in range(args.runs):
                for mode in ways:
                    steps, trial = run_job(args, mode, bed)
                    means[mode].append(statistics.mean(steps))
                    print(f"run {run}: {mode:12s} mean step {statistics.mean(steps):.3f} s, "
                          f"median {statistics.median(steps):.3f} s" + (f"; {trial}" if trial else ""), flush=True)
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
