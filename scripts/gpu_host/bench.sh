#!/usr/bin/env bash
# On the device machine after build.sh: the bench's accelerator scenario where every rank has cores of its
# own. Arguments go to the bench (default: the one-line swap and PyTorch's averager at p = 16, one seed; about
# 80 s a job there); results under $OUT (the device tool's folder) or bench-results/. SENSING_RUNS=n then times
# the sensing's rate on its network, n jobs.
set -u
R="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PATH="$R/.gpu_host_site/bin:$R/.gpu_host_site/lib/bin:$PATH" PYTHONPATH="$R/.gpu_host_site/lib:$R"
export PYTHONUNBUFFERED=1
cd "$R"
python3 -m hvd_dssync bench --scenarios accelerator --steps 400 --max-train-seconds 25 --timeout 90 --no-plots \
    --snapshot-budget-mb 1024 --out "${OUT:-bench-results}/accelerator" \
    --contenders dssync-default,postlocal-hierarchical-p16 "$@"
if [ "${SENSING_RUNS:-0}" -gt 0 ]; then
    python3 -m hvd_dssync.bench.experiments.sensing_rate --runs "$SENSING_RUNS" --networks bandwidth
fi
