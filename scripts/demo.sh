#!/usr/bin/env bash
# The main job, in about two minutes.
#
# With root and network namespaces: 8 emulated hosts in 2 racks behind a 10x slower link (the bench's
# static scenario), a short run each of Horovod's BSP, PyTorch's hierarchical averager at p = 16 (the best
# period of the bench's grid 4, 8, 16 in docs/benchmarks.md's headline; AVERAGERS runs others), DS-Sync as the
# one-line swap gives it (racks sensed) and DS-Sync's best hand-set schedule, side by side, ending with the
# bench's table and its target checks, which name the averagers that ran.
#
# Elsewhere: 4-rank DS-Sync training on scikit-learn's digits, then the same training with Horovod's own
# DistributedOptimizer, on loopback (no bottleneck). horovodrun with the MPI controller, Open MPI
# yielding when idle (4 ranks share 2 cores here; without it, idle ranks busy-wait and the job runs ~10x
# slower).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_DSSYNC_VENV:-$ROOT/.venv}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export PATH="$VENV/bin:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1

if why=$(python -c "import sys; from hvd_dssync.bench.testbed import namespaces_available as a; ok, why = a()
print(why); sys.exit(0 if ok else 1)"); then
    RANKS="${RANKS:-8}"
    SECONDS_EACH="${SECONDS_EACH:-10}"
    DSSYNC="${DSSYNC:-dssync-topology-local}"
    echo "=== emulated cluster: $RANKS hosts in 2 racks, 400 Mbit/s host links, 40 Mbit/s between racks;"
    AVERAGERS="${AVERAGERS:-postlocal-hierarchical-p16}"
    echo "=== horovod-bsp, $AVERAGERS, dssync-default and $DSSYNC, ${SECONDS_EACH} s of training each ==="
    python -m hvd_dssync bench --ranks "$RANKS" --racks 2 --scenarios static --no-plots --out "$out" \
        --contenders "horovod-bsp,$AVERAGERS,dssync-default,$DSSYNC" --steps 400 --max-train-seconds "$SECONDS_EACH"
    exit
fi

echo "=== no network namespaces here ($why): the loopback comparison instead, no bottleneck ==="
NP="${NP:-4}"
EPOCHS="${EPOCHS:-12}"
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
launch=(timeout 900 horovodrun -np "$NP" -H "localhost:$NP" --mpi --mpi-args="--oversubscribe --bind-to none")
for optimizer in dssync horovod; do
    echo "=== $optimizer: horovodrun -np $NP --mpi, $EPOCHS epochs ==="
    "${launch[@]}" python "$ROOT/examples/pytorch_digits.py" --optimizer "$optimizer" --epochs "$EPOCHS" \
        --json "$out/$optimizer.json"
done
python "$ROOT/hvd_dssync/bench/experiments/compare.py" "$out/dssync.json" "$out/horovod.json"
