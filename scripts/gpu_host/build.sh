#!/usr/bin/env bash
# On the device machine (its image: Python 3.12, a CUDA PyTorch, CMake 4, GCC 13, no ip/tc, no network):
# builds the project's Horovod for PyTorch and Gloo on CPU tensors into .gpu_host_site/, as on CI but for that
# Python, and puts ip and tc on PATH there. Needs .gpu_host/ from prepare.sh.
set -euo pipefail
R="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE="$R/.gpu_host_site"
mkdir -p "$SITE/bin"
# iproute2 from Debian, run through the loader so that only ip and tc see its libraries (a process that
# `ip netns exec` starts does not inherit them).
libs="$R/.gpu_host/iproute2/usr/lib/x86_64-linux-gnu:$R/.gpu_host/iproute2/lib/x86_64-linux-gnu"
for tool in bin/ip sbin/tc; do
    printf '#!/bin/sh\nexec /lib64/ld-linux-x86-64.so.2 --library-path %s %s "$@"\n' "$libs" \
        "$R/.gpu_host/iproute2/$tool" > "$SITE/bin/${tool#*/}"
    chmod +x "$SITE/bin/${tool#*/}"
done
python3 -m pip install -q --no-deps --no-index --upgrade --target "$SITE/lib" "$R"/.gpu_host/whl/*.whl
build=$(mktemp -d)
tar -xzf "$R/.gpu_host/horovod-patched.tar.gz" -C "$build"
cd "$build/horovod-0.28.1"
# Horovod's ops on CPU tensors beside a CUDA PyTorch (what CI builds); CMake 4 refuses gloo's old minimum;
# GCC 13 wants headers that Horovod 0.28.1 includes through others.
sed -i '25s/print(True if .*$/print(False)"/' cmake/Modules/FindPytorch.cmake
export CMAKE_POLICY_VERSION_MINIMUM=3.5 CXXFLAGS="-include cstdint -include string -include stdexcept -include limits"
PYTHONPATH="$SITE/lib" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="-j$(nproc)" \
    python3 -m pip wheel -q --no-build-isolation --no-deps . -w "$build/wheel" > "$build/build.log" 2>&1 \
    || { tail -n 40 "$build/build.log"; exit 1; }
python3 -m pip install -q --no-deps --no-index --target "$SITE/lib" "$build"/wheel/horovod-*.whl
PYTHONPATH="$SITE/lib:$R" python3 -m hvd_dssync info | head -9 || true
