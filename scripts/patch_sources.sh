#!/usr/bin/env bash
# Applies the project's build changes to an unpacked Horovod 0.28.1 sdist (its one argument): C++17 for the
# whole tree, then scripts/patch_horovod.py, then scripts/patches/*.patch in order. Used by setup.sh and by
# scripts/gpu_host/prepare.sh, so that both build the same sources.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$1"
# C++17 for the whole tree: torch >= 2.1 needs it, and gloo must match (horovod PR #3998).
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
sed -i 's/-std=c++11/-std=c++17/' "$src/third_party/gloo/CMakeLists.txt"
# Process sets: their Gloo contexts (interface, cross-host scope), dynamic sets agreed every few cycles;
# waits that sleep between polls.
python3 "$ROOT/scripts/patch_horovod.py" "$src"
# Larger patches as unified diffs, each with a header saying what and why.
for diff in "$ROOT"/scripts/patches/*.patch; do
    patch -p1 -s -d "$src" < "$diff"
done
grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'c++17' "$src/third_party/gloo/CMakeLists.txt"
