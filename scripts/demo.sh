#!/usr/bin/env bash
# The main job: 4-rank DS-Sync training on scikit-learn's digits, then the same training with Horovod's
# own DistributedOptimizer, side by side. horovodrun on loopback, MPI controller, Open MPI yielding
# when idle (4 ranks share 2 cores here; without it, idle ranks busy-wait and the job runs ~10x slower).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_DSSYNC_VENV:-$ROOT/.venv}"
NP="${NP:-4}"
EPOCHS="${EPOCHS:-12}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export PATH="$VENV/bin:$PATH" OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1 \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
launch=(timeout 900 horovodrun -np "$NP" -H "localhost:$NP" --mpi --mpi-args="--oversubscribe --bind-to none")
for optimizer in dssync horovod; do
    echo "=== $optimizer: horovodrun -np $NP --mpi, $EPOCHS epochs ==="
    "${launch[@]}" python "$ROOT/examples/pytorch_digits.py" --optimizer "$optimizer" --epochs "$EPOCHS" \
        --json "$out/$optimizer.json"
done
python "$ROOT/scripts/compare.py" "$out/dssync.json" "$out/horovod.json"
