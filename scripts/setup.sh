#!/usr/bin/env bash
# Idempotent set-up for hvd_dssync: system packages, a pinned virtual environment, and Horovod 0.28.1
# built from its PyPI sdist with PyTorch, TensorFlow, Gloo and MPI (patched for C++17, for process sets'
# Gloo contexts: HOROVOD_GLOO_IFACE and the cross-host rendezvous, for dynamic process sets agreed every few
# cycles, and for waits that sleep instead of spinning: scripts/patch_horovod.py; for process sets whose CPU
# collectives run side by side: scripts/patches/*.patch). The built wheel is cached outside the clone, keyed
# by versions and the patch level.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_DSSYNC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.15.1
CACHE="${HVD_DSSYNC_CACHE:-$HOME/.cache/hvd_dssync}"
HOROVOD_PATCH=patch11  # raise with every change to the build's patches: a venv with another build is rebuilt
# The patches' own hash too: a patch edited without a new level still rebuilds.
PATCH_HASH=$(cat "$ROOT/scripts/patch_sources.sh" "$ROOT/scripts/patch_horovod.py" "$ROOT"/scripts/patches/*.patch | sha1sum | cut -c1-8)
WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-tf$TF_VERSION-$HOROVOD_PATCH-$PATCH_HASH"
HOROVOD_MARK="$VENV/.horovod-$HOROVOD_VERSION-$HOROVOD_PATCH-$PATCH_HASH"
STAMP="$VENV/.hvd_dssync-setup-$(sha1sum "$ROOT/requirements.txt" "$0" | sha1sum | cut -c1-12)-$PATCH_HASH"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ -f "$STAMP" ]; then
    exit 0
fi

# --- system packages -------------------------------------------------------------------------
need_apt=()
for pkg in openmpi-bin libopenmpi-dev cmake g++ iproute2 patch; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    log "installing Debian packages: ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# --- virtual environment ---------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
pip_install() {
    # pip's warnings about this machine's extra package locations are noise; real errors still show.
    local out
    if ! out=$("$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
        printf '%s\n' "$out" >&2
        return 1
    fi
    printf '%s\n' "$out" | grep -v -e "is ignored: it is neither" -e '^$' || true
}
log "installing pinned Python packages"
pip_install --upgrade "pip<25" wheel
pip_install -r "$ROOT/requirements.txt"

# --- Horovod ---------------------------------------------------------------------------------
if [ ! -f "$HOROVOD_MARK" ] || \
   ! "$VENV/bin/python" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
    wheel=$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$wheel" ]; then
        log "building Horovod $HOROVOD_VERSION (once, about 8 minutes on 2 cores); cache: $WHEEL_DIR"
        build=$(mktemp -d)
        trap 'rm -rf "$build"' EXIT
        "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
        tar -xzf "$build"/horovod-$HOROVOD_VERSION.tar.gz -C "$build"
        src="$build/horovod-$HOROVOD_VERSION"
        bash "$ROOT/scripts/patch_sources.sh" "$src"
        (cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
            HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
            "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps . -w "$build/wheel" \
            > "$build/build.log" 2>&1) || { tail -n 60 "$build/build.log"; log "Horovod build failed"; exit 1; }
        mkdir -p "$WHEEL_DIR"
        cp "$build"/wheel/horovod-*.whl "$WHEEL_DIR/"
        wheel=$(ls "$WHEEL_DIR"/horovod-*.whl | head -n1)
    fi
    log "installing $(basename "$wheel")"
    pip_install --no-deps --force-reinstall "$wheel"
    pip_install cloudpickle psutil pyyaml packaging cffi
    rm -f "$VENV"/.horovod-*
    touch "$HOROVOD_MARK"
fi

# PEP 660 editable install (pyproject.toml) with the pinned setuptools: no legacy "setup.py develop".
pip_install --no-deps --no-build-isolation -e "$ROOT"

# --- check -----------------------------------------------------------------------------------
caps=$("$VENV/bin/horovodrun" -cb 2>/dev/null)
for want in "PyTorch" "TensorFlow" "MPI" "Gloo"; do
    if ! grep -q "\[X\] $want" <<<"$caps"; then
        echo "$caps"
        log "Horovod lacks $want support: delete $WHEEL_DIR and run again"
        exit 1
    fi
done
touch "$STAMP"
log "ready: $VENV"
