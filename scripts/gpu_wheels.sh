#!/usr/bin/env bash
# Download into .whl/ the wheels scripts/gpu_check.sh installs offline on the GPU machine.
#
#   bash scripts/gpu_wheels.sh          # needs PyPI; run on a machine with network
#
# The GPU machine (Python 3.12, x86_64, no network) has torch, cuda-bindings, pytest,
# hypothesis, safetensors, tokenizers, transformers, rich, click, psutil, matplotlib,
# prometheus-client and httpx, but not what the daemon (pyzmq, msgspec) and the engine's
# HTTP server (FastAPI, uvicorn, starlette, pydantic) need. Their dependencies are named one
# by one (no resolver runs: --no-deps), pinned to the versions of this checkout's .venv
# when it has them (so the GPU runs what the tests ran here), else to the fallback pins.
# .whl/ is git-ignored; hand it to the device run as a carried path.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DIR:-.whl}
PYVER=${GPU_WHEELS_PYTHON:-3.12}

# name==fallback version; the venv's version wins when installed there
PINS=(
    pyzmq==27.3.0 msgspec==0.23.0
    fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7
    typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 idna==3.20
    pytest-timeout==2.4.0
)

venv_version() {  # the version of $1 installed in .venv, or nothing
    [ -x .venv/bin/python ] || return 0
    .venv/bin/python -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1" 2>/dev/null || true
}

PIP=(python3 -m pip)
[ -x .venv/bin/pip ] && PIP=(.venv/bin/pip)
mkdir -p "$DEST"
for pin in "${PINS[@]}"; do
    name=${pin%%==*}
    version=$(venv_version "$name")
    version=${version:-${pin#*==}}
    echo "== $name==$version"
    "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$DEST" "$name==$version"
done
ls -l "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
