#!/usr/bin/env bash
# Run HERE (with network), before the device runs: fills .gpu_host/ (ignored) with what a GPU machine that
# cannot reach the network needs to run the bench: the project's patched Horovod sources, iproute2 (ip, tc)
# unpacked with its libraries, and cffi (Horovod's build asks for it). Then, on the device machine, from the
# repository root with .gpu_host carried: `bash scripts/gpu_host/build.sh && bash scripts/gpu_host/bench.sh`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/.gpu_host"
rm -rf "$OUT" && mkdir -p "$OUT/src" "$OUT/debs" "$OUT/whl"
python3 -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$OUT"
tar -xzf "$OUT"/horovod-0.28.1.tar.gz -C "$OUT/src" && rm "$OUT"/horovod-0.28.1.tar.gz
bash "$ROOT/scripts/patch_sources.sh" "$OUT/src/horovod-0.28.1"
tar -czf "$OUT/horovod-patched.tar.gz" -C "$OUT/src" horovod-0.28.1 && rm -rf "$OUT/src"
(cd "$OUT/debs" && apt-get download -q iproute2 libbpf1 libelf1 libmnl0 libxtables12 libtirpc3 libdb5.3 libcap2 \
    libbsd0 libmd0 2>/dev/null)
for deb in "$OUT"/debs/*.deb; do dpkg -x "$deb" "$OUT/iproute2"; done && rm -rf "$OUT/debs"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT/whl" cffi pycparser
du -sh "$OUT"
