#!/usr/bin/env bash
# Whole-stack GPU check of kvpool in one call that fits a short GPU loan (8 minutes).
#
#   bash scripts/gpu_wheels.sh                # once, where PyPI is reachable: fills .whl/
#   OUT=/some/dir bash scripts/gpu_check.sh   # logs, JSON and the summary under $OUT
#   bash scripts/gpu_check.sh                 # ... under a temp dir (printed at the end)
#
# On the lent GPU machine (offline; the repo copy has no .venv): carry `.whl` with the
# working tree and run `bash scripts/gpu_check.sh` with a call limit of about 560 s; the
# logs, summary and results/*_cuda.json come back under $OUT.
#
# Steps, in order. Each runs under `timeout` with a limit cut from what is left of the
# budget minus the minimum the later steps need, so a failure or hang in one still leaves
# the others' results; processes a step started (daemons, servers) are killed after it.
#   setup         python: $GPU_CHECK_PY, else .venv/bin/python if it imports torch, else
#                 python3; when the daemon's/servers' modules are missing, the wheels of
#                 .whl/ are installed offline into a temp dir put on PYTHONPATH
#   diagnostics   nvidia-smi, kernel, versions, `kvpool info`, the CUDA capability probe
#   pytest-gpu    pytest -m gpu (every file with GPU tests); fails if any is skipped on a
#                 machine with a GPU (scripts/gpu_junit.py reads the JUnit XML)
#                 (among them test_vmm_cuda.py::test_map_read_only_refuses_writes: the
#                 read-only mapping weight sets need, CudaBackend.map_read_only, and
#                 ::test_weight_set_through_a_daemon: a set created through a CUDA daemon,
#                 attached by a second process, its store faulting;
#                 ::test_mutable_set_through_a_daemon: a mutable weight set (issue 37
#                 item 3), its reader's cuMemSetAccess read-only mapping following a
#                 published version by remap, its store faulting; and
#                 ::test_devices_all_serves_every_gpu: `kvpool daemon --devices all`, one
#                 pool per GPU; untested on a GPU until this runs; and
#                 tests/client/test_cuda_pool_alloc.py::test_a_cuda_step_allocates_from_its_pool_pages:
#                 a trainer tenant's CUDA training step whose allocations go through
#                 torch.cuda.MemPool to its step's pool pages, untested on a GPU until
#                 this runs)
#   pytest-stub   the libcuda stub tests (calling conventions; skip without gcc)
#   vmm-bench     benchmarks/vmm_bench.py --backend cuda: per-op cost per 2 MiB page
#   alloc-bench   benchmarks/alloc_bench.py --backend cuda --quick: fast path, slow/floor
#   daemon        benchmarks/gpu_daemon_check.py --backend cuda: two tenants, kill -9,
#                 free memory back, zeros, fresh pages for a new tenant
#   engine-bench  benchmarks/elastic_overhead_bench.py --backend cuda: 1.1B bf16 Llama,
#                 per_layer and block_major, batch 1/8/32, elastic/static and tokens/s
#   demo          benchmarks/gpu_demo.py --backend cuda: shortened `kvpool demo`, three
#                 such models, KV binding: TTFT p99/mean static / elastic
# Then a summary table (pass / FAIL / TIMEOUT / SKIPPED per step) and the headline figures
# (scripts/gpu_figures.py) in summary.txt, summary.json, and every
# benchmarks/results/*_cuda.json written by the run copied into results/ under the log dir.
#
# Without a GPU every GPU step is SKIPPED and the exit status is 0 (tests/test_gpu_check.py).
# Knobs: GPU_CHECK_BUDGET (seconds, default 465); GPU_CHECK_STEPS="daemon demo" runs only
# those (plus setup); GPU_CHECK_SMOKE=1 runs the GPU steps' scripts on the host backend with
# tiny sizes instead of skipping them (checks their plumbing on a CPU machine; results go
# under the log dir only); GPU_CHECK_FORCE_INSTALL=1 installs .whl/ even when not needed;
# GPU_CHECK_TIMEOUTS="demo=200 daemon=30" sets steps' limits (seconds, still cut to what is
# left of the budget); GPU_CHECK_FORCE_CPU=1 acts as if
# there were no GPU; GPU_CHECK_PY forces the interpreter.
# Exit status: 0 when no step failed or timed out, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-465}   # the device call's limit is 600 s; the issue's cap is 480
DEADLINE=$((START + BUDGET))
SMOKE=${GPU_CHECK_SMOKE:-0}
SELECTED=${GPU_CHECK_STEPS:-}
if [ -n "${OUT:-}" ]; then LOGDIR=$OUT; else LOGDIR=$(mktemp -d /tmp/kvpool-gpu-check.XXXXXX); fi
mkdir -p "$LOGDIR/results"
MAIN_LOG=$LOGDIR/gpu_check.log
: >"$MAIN_LOG"
STAMP=$LOGDIR/.started
touch "$STAMP"
WORK=$(mktemp -d /tmp/kvpool-gpu-work.XXXXXX)   # models and scratch: never under $OUT
export KVPOOL_BENCH_MODELS=$WORK/models
TAG="kvpool-gpu-check-$$"
export KVPOOL_GPU_CHECK_TAG=$TAG   # inherited by everything a step starts (see reap)

# step name, seconds wanted, seconds reserved for it while earlier steps run
STEPS=(diagnostics pytest-gpu pytest-stub vmm-bench alloc-bench daemon engine-bench demo)
declare -A WANT=([diagnostics]=45 [pytest-gpu]=110 [pytest-stub]=30 [vmm-bench]=60
                 [alloc-bench]=60 [daemon]=60 [engine-bench]=130 [demo]=240)
declare -A MIN=([diagnostics]=10 [pytest-gpu]=30 [pytest-stub]=0 [vmm-bench]=15
                [alloc-bench]=20 [daemon]=20 [engine-bench]=45 [demo]=60)
for kv in ${GPU_CHECK_TIMEOUTS:-}; do
    if [[ $kv =~ ^([a-z-]+)=([0-9]+)$ ]] && [ -n "${WANT[${BASH_REMATCH[1]}]:-}" ]; then
        WANT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
    else
        echo "gpu_check.sh: bad GPU_CHECK_TIMEOUTS entry '$kv' (want STEP=SECONDS)" >&2; exit 2
    fi
done
RESULT_NAMES=() RESULT_STATUS=() RESULT_SECS=() RESULT_NOTE=()
FAILED=0
PY=""
HAS_GPU=0

say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$MAIN_LOG"; }

record() {  # record NAME STATUS SECONDS NOTE
    RESULT_NAMES+=("$1") RESULT_STATUS+=("$2") RESULT_SECS+=("$3") RESULT_NOTE+=("${4:-}")
    case $2 in ok | SKIPPED) ;; *) FAILED=1 ;; esac
}

selected() { [ -z "$SELECTED" ] || [ "$1" = diagnostics ] || [[ " $SELECTED " == *" $1 "* ]]; }

# seconds the later steps keep in reserve while step $1 runs
reserve_after() {
    local seen=0 sum=0 s
    for s in "${STEPS[@]}"; do
        if [ "$seen" = 1 ] && selected "$s"; then sum=$((sum + MIN[$s])); fi
        [ "$s" = "$1" ] && seen=1
    done
    echo "$sum"
}

# kill whatever a step left behind (its processes carry $TAG in their environment)
reap() {
    local pid env
    for env in /proc/[0-9]*/environ; do
        pid=${env#/proc/}; pid=${pid%/environ}
        [ "$pid" = "$$" ] && continue
        if grep -qzx "KVPOOL_GPU_CHECK_TAG=$TAG" "$env" 2>/dev/null; then
            kill -9 "$pid" 2>/dev/null && say "killed leftover process $pid ($(tr '\0' ' ' \
                </proc/"$pid"/cmdline 2>/dev/null | cut -c1-80))"
        fi
    done
}

# run_step NAME GPU_ONLY CMD...: CMD under timeout; its output in NAME.log
run_step() {
    local name=$1 gpu_only=$2
    shift 2
    if ! selected "$name"; then record "$name" SKIPPED 0 "not selected"; return 0; fi
    if [ "$gpu_only" = 1 ] && [ "$HAS_GPU" = 0 ] && [ "$SMOKE" != 1 ]; then
        say "SKIPPED $name: no GPU on this machine"
        record "$name" SKIPPED 0 "no GPU"
        return 0
    fi
    local left limit t0 rc dt status note=""
    left=$((DEADLINE - $(date +%s) - $(reserve_after "$name")))
    limit=${WANT[$name]}
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        say "SKIPPED $name: only ${left}s left in the budget"
        record "$name" "NO-TIME" 0 "budget spent"
        return 1
    fi
    local shown="$*"
    [ "$1" = bash ] && [ "$2" = -c ] && shown="shell function ${3##*; }"
    say "BEGIN $name (timeout ${limit}s): $shown"
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$LOGDIR/$name.log" 2>&1
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    reap
    tail -n 40 "$LOGDIR/$name.log"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=TIMEOUT; note="killed after ${limit}s"
    elif [ "$rc" -ne 0 ]; then status=FAIL; note="rc=$rc; see $name.log"
    else status=ok; fi
    [ -f "$LOGDIR/$name.note" ] && note="${note:+$note; }$(head -c 200 "$LOGDIR/$name.note")"
    say "END   $name: $status in ${dt}s ${note}"
    record "$name" "$status" "$dt" "$note"
    return "$rc"
}

summary() {
    reap
    local i line json="" sep="" esc
    # results written by this run under benchmarks/results/ go back with the logs
    find "$REPO/benchmarks/results" -maxdepth 1 -name '*_cuda.json' -newer "$STAMP" \
        -exec cp {} "$LOGDIR/results/" \; 2>/dev/null
    {
        echo "================ kvpool gpu_check summary ================"
        printf '%-13s %-8s %6s  %s\n' step status secs note
        for i in "${!RESULT_NAMES[@]}"; do
            printf '%-13s %-8s %5ss  %s\n' "${RESULT_NAMES[$i]}" "${RESULT_STATUS[$i]}" \
                "${RESULT_SECS[$i]}" "${RESULT_NOTE[$i]}"
        done
        echo "gpu: $([ "$HAS_GPU" = 1 ] && echo yes || echo no)   smoke: $SMOKE   python: ${PY:-none}"
        echo "total: $(( $(date +%s) - START ))s of ${BUDGET}s   logs: $LOGDIR"
        echo "results: $(cd "$LOGDIR/results" && ls 2>/dev/null | tr '\n' ' ')"
        [ -n "$PY" ] && timeout 30 "$PY" "$REPO/scripts/gpu_figures.py" "$LOGDIR/results" 2>&1
        [ "$FAILED" -eq 0 ] && echo "RESULT: PASS" || echo "RESULT: FAIL"
    } | tee "$LOGDIR/summary.txt" | tee -a "$MAIN_LOG"
    for i in "${!RESULT_NAMES[@]}"; do
        esc=${RESULT_NOTE[$i]//\\/\\\\}; esc=${esc//\"/\\\"}
        json+="$sep{\"step\": \"${RESULT_NAMES[$i]}\", \"status\": \"${RESULT_STATUS[$i]}\", "
        json+="\"seconds\": ${RESULT_SECS[$i]}, \"note\": \"$esc\"}"
        sep=", "
    done
    printf '{"gpu": %s, "smoke": %s, "passed": %s, "total_s": %s, "steps": [%s]}\n' \
        "$([ "$HAS_GPU" = 1 ] && echo true || echo false)" "$([ "$SMOKE" = 1 ] && echo true || echo false)" \
        "$([ "$FAILED" -eq 0 ] && echo true || echo false)" "$(( $(date +%s) - START ))" \
        "$json" >"$LOGDIR/summary.json"
    rm -rf "$WORK" "$STAMP"
}
trap summary EXIT
trap 'say "interrupted"; exit 1' INT TERM

# ---- setup ------------------------------------------------------------------------
# (.venv is a developer's checkout; the GPU machine gets none: it runs its python3)
nvidia_present() { nvidia-smi -L >/dev/null 2>&1 || ls /dev/nvidia[0-9]* >/dev/null 2>&1; }
pick_python() {
    if [ -n "${GPU_CHECK_PY:-}" ]; then echo "$GPU_CHECK_PY"; return; fi
    local venv=$REPO/.venv/bin/python
    if [ -x "$venv" ] && { ! nvidia_present || "$venv" -c \
        'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
    then echo "$venv"; return; fi  # on a GPU machine, only a .venv whose torch has CUDA
    command -v python3
}
NEEDED='import zmq, msgspec, fastapi, uvicorn, starlette, pydantic, click, rich, psutil, httpx, prometheus_client, safetensors, tokenizers, numpy, torch'

install_wheels() {  # the carried wheels, offline, into a temp dir on PYTHONPATH
    local site=${GPU_CHECK_SITE:-$WORK/site} whl
    if ! ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
        say "no wheels in .whl/ (run scripts/gpu_wheels.sh where PyPI is reachable)"
        return 1
    fi
    mkdir -p "$site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
            --target "$site" "$REPO"/.whl/*.whl >>"$MAIN_LOG" 2>&1; then
        say "pip could not install .whl/; unpacking the wheels instead"
        for whl in "$REPO"/.whl/*.whl; do "$PY" -m zipfile -e "$whl" "$site" || return 1; done
    fi
    export PYTHONPATH="$REPO:$site${PYTHONPATH#"$REPO"}"
    say "installed $(ls "$REPO"/.whl/*.whl | wc -l) wheels from .whl/ into $site"
}

setup() {
    PY=$(pick_python)
    [ -n "$PY" ] || { say "no python found"; return 1; }
    command -v "$PY" >/dev/null || { say "python $PY not found"; PY=""; return 1; }
    say "python: $PY ($("$PY" -V 2>&1))"
    if [ "${GPU_CHECK_FORCE_INSTALL:-0}" = 1 ] || ! "$PY" -c "$NEEDED" 2>/dev/null; then
        install_wheels || true
    fi
    local rc=0
    if ! "$PY" -c "$NEEDED" >>"$MAIN_LOG" 2>&1; then
        say "python lacks modules kvpool needs: $("$PY" -c "$NEEDED" 2>&1 | tail -1)"
        rc=1  # go on: the steps that need less (the vmm tests) still tell something
    fi
    local smi=0
    if nvidia-smi -L >>"$MAIN_LOG" 2>&1; then smi=1; else say "nvidia-smi finds no GPU"; fi
    # torch decides (a GPU it cannot use would only make every GPU step fail); with neither
    # nvidia-smi nor an NVIDIA device node there is nothing to ask it about
    if { [ "$smi" = 1 ] || ls /dev/nvidia[0-9]* >/dev/null 2>&1; } && "$PY" -c \
        'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>>"$MAIN_LOG"
    then HAS_GPU=1; fi
    if [ "$smi" = 1 ] && [ "$HAS_GPU" = 0 ]; then
        say "nvidia-smi lists a GPU but torch ($PY) cannot use it"
        rc=1
    fi
    [ "${GPU_CHECK_FORCE_CPU:-0}" = 1 ] && HAS_GPU=0
    say "GPU: $([ "$HAS_GPU" = 1 ] && { nvidia-smi -L 2>/dev/null | head -1 || echo yes; } || echo none)"
    return "$rc"
}
t0=$(date +%s)
if setup; then record setup ok $(( $(date +%s) - t0 ))
else record setup FAIL $(( $(date +%s) - t0 )) "missing modules: see gpu_check.log"; fi
[ -n "$PY" ] || exit 1
export PY LOGDIR REPO HAS_GPU SMOKE

# ---- steps ------------------------------------------------------------------------
diagnostics() {
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_mode \
        --format=csv 2>&1 || true
    echo "kernel: $(uname -r)   cpus: $(nproc)"
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for mod in ("torch", "cuda.bindings", "pytest", "numpy", "click", "rich", "msgspec", "zmq",
            "fastapi", "uvicorn", "pydantic", "psutil", "safetensors", "tokenizers"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod:14s} {getattr(m, '__version__', 'ok')}  {getattr(m, '__file__', '')}")
    except Exception as e:
        print(f"  {mod:14s} MISSING ({type(e).__name__}: {e})")
import torch
print("torch.cuda:", torch.version.cuda, "available:", torch.cuda.is_available())
from kvpool.vmm.cuda import probe
reason = probe()
print("probe():", reason or "ok: the CUDA backend can run on device 0")
if reason is None:
    from kvpool.vmm.cuda import CudaBackend
    b = CudaBackend()
    print("min_page_size", b.min_page_size(), "page_size", b.page_size, "rdma", b.rdma_capable,
          "uuid", b.device_uuid(), "mem_info", b.mem_info())
    b.close()
EOF
    "$PY" -m kvpool.cli.main info
}

pytest_gpu() {
    local files
    files=$(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include='*.py' | sort | tr '\n' ' ')
    echo "GPU test files: ${files:-none (running tests/)}"
    # shellcheck disable=SC2086
    "$PY" -m pytest -m gpu ${files:-tests/} -v -rA -p no:cacheprovider \
        --junitxml="$LOGDIR/pytest-gpu.xml"
    local rc=$?
    local gpu_flag=""
    [ "$HAS_GPU" = 1 ] && gpu_flag=--gpu
    "$PY" scripts/gpu_junit.py "$LOGDIR/pytest-gpu.xml" $gpu_flag | tee "$LOGDIR/pytest-gpu.note"
    local verdict=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] && [ "$verdict" -eq 0 ]
}

pytest_stub() {
    "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_vmm_cuda_stub.py \
        --junitxml="$LOGDIR/pytest-stub.xml"
    local rc=$?
    "$PY" scripts/gpu_junit.py "$LOGDIR/pytest-stub.xml" >"$LOGDIR/pytest-stub.note"
    return "$rc"
}

if [ "$HAS_GPU" = 1 ]; then
    BACKEND=cuda
    # shellcheck disable=SC2034
    OUTARG() { :; }   # the step scripts write benchmarks/results/<name>_cuda.json
    VMM=(--pages 1024) ALLOC=() DAEMON=(--pages 128)
    ENGINE=(--model llama-1b --dtype bfloat16 --layouts per_layer,block_major --batches 1,8,32
            --reps 10 --steps 10 --warmup 5 --kv-cache-size 1GiB --budget 4GiB)
    DEMO=(--model llama-1b --duration 20)
else  # smoke: host backend, tiny sizes, results only under the log dir
    BACKEND=host
    VMM=(--pages 32 --out "$LOGDIR/results/vmm_bench_host.json")
    ALLOC=(--out "$LOGDIR/results/alloc_bench_host.json")
    DAEMON=(--pages 16 --out "$LOGDIR/results/gpu_daemon_check_host.json")
    ENGINE=(--model tiny --layouts per_layer,block_major --batches 1,8 --quick
            --out "$LOGDIR/results/elastic_overhead_bench_host.json")
    DEMO=(--model tiny --duration 6 --out "$LOGDIR/results/demo_host.json")
fi

run_step diagnostics 0 bash -c "$(declare -f diagnostics); diagnostics"
run_step pytest-gpu 1 bash -c "$(declare -f pytest_gpu); pytest_gpu"
run_step pytest-stub 1 bash -c "$(declare -f pytest_stub); pytest_stub"
run_step vmm-bench 1 "$PY" benchmarks/vmm_bench.py --backend "$BACKEND" --page-size 2MiB "${VMM[@]}"
run_step alloc-bench 1 "$PY" benchmarks/alloc_bench.py --backend "$BACKEND" --quick "${ALLOC[@]}"
run_step daemon 1 "$PY" benchmarks/gpu_daemon_check.py --backend "$BACKEND" "${DAEMON[@]}"
run_step engine-bench 1 "$PY" benchmarks/elastic_overhead_bench.py --backend "$BACKEND" "${ENGINE[@]}"
mkdir -p "$LOGDIR/demo"
run_step demo 1 "$PY" benchmarks/gpu_demo.py --backend "$BACKEND" --workdir "$WORK/demo" "${DEMO[@]}"
for f in results.json memory.png logs; do  # the demo's own outputs (its models stay behind)
    [ -e "$WORK/demo/$f" ] && cp -r "$WORK/demo/$f" "$LOGDIR/demo/"
done
[ "$FAILED" -eq 0 ]
