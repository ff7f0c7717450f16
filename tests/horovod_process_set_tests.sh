#!/usr/bin/env bash
# Horovod's own process-set tests, unswapped, on the installed Horovod: test_torch.py's tests with
# "process_set" in their name and test_tensorflow_process_sets.py's CPU tests, under horovodrun --gloo and
# mpirun (MPI controller and operations), at 2 and 4 ranks; each job once, under a timeout. Prints one line
# per job with pytest's counts. Usage: tests/horovod_process_set_tests.sh HOROVOD_SOURCE (a checkout of
# Horovod v0.28.1; its tests are not in the sdist). `make horovod-process-set-tests` runs it.
set -uo pipefail
src="${1:?usage: $0 HOROVOD_SOURCE}"
tests="$src/test/parallel"
[ -d "$tests" ] || { echo "no $tests: give a checkout of Horovod v0.28.1" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
"$PY" -c "import mock" 2>/dev/null || "$PY" -m pip install -q mock  # Horovod's test utilities import it
files="${HOROVOD_TEST_FILES:-test_torch.py:process_set|test_tensorflow_process_sets.py:not gpu}"
export OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 HOROVOD_GLOO_IFACE=lo PYTHONUNBUFFERED=1
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo
failed=0
IFS='|' read -ra selections <<< "$files"
for file_and_filter in "${selections[@]}"; do
    file="${file_and_filter%%:*}"; filter="${file_and_filter#*:}"
    for launcher in gloo mpi; do
        for np in 2 4; do
            if [ "$launcher" = gloo ]; then
                cmd=("$ROOT/.venv/bin/horovodrun" -np "$np" -H "localhost:$np" --gloo)
            else
                cmd=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np"
                     -x HOROVOD_CONTROLLER=mpi -x HOROVOD_CPU_OPERATIONS=mpi -x OMP_NUM_THREADS -x PATH
                     -x TF_CPP_MIN_LOG_LEVEL -x PYTHONUNBUFFERED -x HOROVOD_PROCESS_SETS_ASYNC)
            fi
            log=$(mktemp)
            (cd "$tests" && PATH="$ROOT/.venv/bin:$PATH" timeout -k 10 900 "${cmd[@]}" \
                "$PY" -m pytest -q --color=no -p no:cacheprovider "$file" -k "$filter" > "$log" 2>&1)
            rc=$?
            counts=$(grep -E "^(\[0\]<stdout>:)?[0-9]+ (passed|failed|skipped)" "$log" | head -1 | sed 's/^\[0\]<stdout>://')
            echo "$file $launcher np=$np: exit $rc: ${counts:-no summary (see below)}"
            if [ "$rc" -ne 0 ]; then failed=1; tail -n 40 "$log"; fi
            rm -f "$log"
        done
    done
done
exit $failed
