#!/usr/bin/env bash
# One-shot GPU check for kvpool's CUDA backend: finishes in under 8 minutes on an H200.
#
#   bash scripts/gpu_check.sh            # logs on stdout
#   OUT=/some/dir bash scripts/gpu_check.sh   # also writes logs + JSON under $OUT
#
# Steps (each under `timeout`, each sized from what is left of the overall budget):
#   1. python: reuse .venv if it has CUDA torch + cuda-python + pytest; else python3 if
#      it has them (wheels in .whl/ are installed to a temp dir first, offline); else
#      create .venv (.venv-gpu if a CPU .venv exists) and pip install torch + -e .[test]
#      (needs network). GPU_CHECK_PY=/path/to/python forces an interpreter.
#   2. diagnostics: nvidia-smi, kernel, versions, kvpool.vmm.cuda.probe().
#   3. pytest -m gpu tests/                      (the real-GPU tests)
#   4. pytest tests/test_vmm_cuda_stub.py        (stub driver; checks it still wins over
#                                                 the real libcuda via LD_LIBRARY_PATH)
#   5. benchmarks/vmm_bench.py --backend cuda
#   6. summary (always).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-465}     # seconds for everything; the hard cap is 480
DEADLINE=$((START + BUDGET))
OUTDIR=${OUT:-}
if [ -n "$OUTDIR" ]; then
    mkdir -p "$OUTDIR"
    LOGDIR=$OUTDIR
else
    LOGDIR=$(mktemp -d /tmp/kvpool-gpu-check.XXXXXX)
fi
MAIN_LOG=$LOGDIR/gpu_check.log
: >"$MAIN_LOG"
SUMMARY=()
FAILED=0

say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$MAIN_LOG"; }

# run_step NAME WANT_SECONDS KEEP_SECONDS LOGFILE CMD...
#   runs CMD under timeout min(WANT, time left - KEEP); KEEP is reserved for later steps.
run_step() {
    local name=$1 want=$2 keep=$3 log=$4
    shift 4
    local now left limit t0 rc
    now=$(date +%s)
    left=$((DEADLINE - now - keep))
    limit=$want
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        say "SKIP $name: only ${left}s left in the budget"
        SUMMARY+=("$(printf '%-14s %-8s %5ss' "$name" "SKIPPED" 0)")
        FAILED=1
        return 1
    fi
    say "BEGIN $name (timeout ${limit}s): $*"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    local dt=$(( $(date +%s) - t0 ))
    local status="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT"; elif [ "$rc" -ne 0 ]; then status="rc=$rc"; fi
    [ "$status" = ok ] || FAILED=1
    say "END   $name: $status in ${dt}s"
    SUMMARY+=("$(printf '%-14s %-8s %5ss' "$name" "$status" "$dt")")
    return "$rc"
}

summary() {
    say "================ summary ================"
    for line in "${SUMMARY[@]}"; do say "$line"; done
    say "python: ${PY:-none}   total: $(( $(date +%s) - START ))s   logs: $LOGDIR"
    [ -f "$LOGDIR/gpu_pytest.log" ] && say "pytest: $(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|^=+ .*(passed|failed|error).* =+$' "$LOGDIR/gpu_pytest.log" | tail -1)"
    [ "$FAILED" -eq 0 ] && say "RESULT: PASS" || say "RESULT: FAIL"
}
trap summary EXIT

# ---- 1. python ------------------------------------------------------------------
CHECK_PY='
import sys
try:
    from cuda.bindings import driver
except ImportError:
    from cuda import cuda as driver
import pytest, torch
assert torch.cuda.is_available(), "torch has no CUDA device"
print(sys.executable, "torch", torch.__version__, "pytest", pytest.__version__)
'
py_ok() { [ -x "$(command -v "$1" 2>/dev/null)" ] && timeout 90 "$1" -c "$CHECK_PY" >>"$MAIN_LOG" 2>&1; }

# seconds a network install may take: what is left, minus ~4 minutes for the checks
install_limit() { local l=$((DEADLINE - $(date +%s) - 240)); [ "$l" -lt 30 ] && l=30; echo "$l"; }

setup_python() {
    if [ -n "${GPU_CHECK_PY:-}" ]; then PY=$GPU_CHECK_PY; say "using GPU_CHECK_PY=$PY unchecked"; return 0; fi
    if py_ok "$REPO/.venv/bin/python"; then PY=$REPO/.venv/bin/python; return 0; fi
    say ".venv missing or without CUDA torch/cuda-python/pytest"
    if [ -d "$REPO/.whl" ] && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
        say "installing carried wheels from .whl/ into /tmp/kvpool-site (offline)"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/kvpool-site "$REPO"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/kvpool-site"
    fi
    if py_ok python3; then PY=$(command -v python3); say "using python3 as is (PYTHONPATH=$REPO)"; return 0; fi
    # Never clobber a working CPU .venv of a developer: build .venv-gpu next to it.
    local venv=$REPO/.venv
    [ -e "$venv" ] && venv=$REPO/.venv-gpu
    say "creating $venv and installing torch + kvpool[test] (needs network)"
    if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv" || return 1; fi
    timeout "$(install_limit)" "$venv/bin/pip" install -q torch 2>&1 | tee -a "$MAIN_LOG" || return 1
    timeout "$(install_limit)" "$venv/bin/pip" install -q -e "$REPO[test]" 2>&1 | tee -a "$MAIN_LOG" || return 1
    py_ok "$venv/bin/python" && PY=$venv/bin/python
}

if ! nvidia-smi -L >>"$MAIN_LOG" 2>&1; then
    say "WARNING: nvidia-smi finds no GPU here"
    if [ -z "${GPU_CHECK_PY:-}" ]; then
        SUMMARY+=("$(printf '%-14s %-8s %5ss' gpu MISSING 0)")
        FAILED=1
        exit 1
    fi
fi
PY=""
t0=$(date +%s)
setup_python
dt=$(( $(date +%s) - t0 ))
if [ -z "$PY" ]; then
    say "no usable python environment (see $MAIN_LOG)"
    SUMMARY+=("$(printf '%-14s %-8s %5ss' setup FAILED "$dt")")
    FAILED=1
    exit 1
fi
SUMMARY+=("$(printf '%-14s %-8s %5ss' setup ok "$dt")")
say "python: $PY"
export PY

# ---- 2. diagnostics ---------------------------------------------------------------
diagnostics() {
    nvidia-smi -L 2>&1 || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_mode --format=csv 2>&1 || true
    echo "kernel: $(uname -r)"
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for mod in ("torch", "cuda.bindings", "cuda.pathfinder", "pytest", "numpy", "click", "rich",
            "msgspec", "zmq", "psutil"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod:16s} {getattr(m, '__version__', 'ok')}")
    except Exception as e:
        print(f"  {mod:16s} MISSING ({type(e).__name__}: {e})")
import torch
print("torch.cuda:", torch.version.cuda, torch.cuda.get_device_name(0))
from kvpool.vmm.cuda import CudaBackend, probe
print("probe():", probe())
b = CudaBackend()
print("granularity", b.granularity(), "page_size", b.page_size, "rdma", b.rdma_capable,
      "uuid", b.device_uuid(), "mem_info", b.mem_info())
b.close()
EOF
}
run_step diagnostics 60 330 "$LOGDIR/gpu_env.log" bash -c "$(declare -f diagnostics); diagnostics"

# ---- 3. GPU tests -------------------------------------------------------------------
run_step pytest-gpu 240 100 "$LOGDIR/gpu_pytest.log" \
    "$PY" -m pytest -m gpu tests/ -v -rA -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$LOGDIR/gpu_pytest.xml"
if ! grep -qE '[0-9]+ passed' "$LOGDIR/gpu_pytest.log" 2>/dev/null; then
    say "pytest-gpu ran no test to a pass (all skipped? see probe() in gpu_env.log)"
    SUMMARY+=("$(printf '%-14s %-8s %5ss' pytest-gpu NO-PASS 0)")
    FAILED=1
fi

# ---- 4. stub tests (calling conventions; cheap) --------------------------------------
run_step pytest-stub 45 75 "$LOGDIR/stub_pytest.log" \
    "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_vmm_cuda_stub.py

# ---- 5. benchmark -----------------------------------------------------------------
BENCH_JSON=$LOGDIR/vmm_bench_cuda.json
if [ -f benchmarks/vmm_bench.py ]; then
    run_step bench-cuda 150 0 "$LOGDIR/vmm_bench.log" \
        "$PY" benchmarks/vmm_bench.py --backend cuda --pages 1024 --page-size 2MiB --out "$BENCH_JSON"
    [ -z "$OUTDIR" ] && [ -f "$BENCH_JSON" ] && cat "$BENCH_JSON"
else
    say "SKIP bench-cuda: benchmarks/vmm_bench.py not found"
    SUMMARY+=("$(printf '%-14s %-8s %5ss' bench-cuda MISSING 0)")
    FAILED=1
fi
[ "$FAILED" -eq 0 ]
