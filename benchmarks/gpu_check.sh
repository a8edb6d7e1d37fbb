#!/usr/bin/env bash
# GPU check, run once from the repo root on a CUDA machine: tests/trainer/test_gpu.py plus the trainer and weights
# benchmarks on the Qwen3-0.6B shape. Everything is teed into $OUT/gpu_check.log (or ./gpu_check.log).
#
#   bash benchmarks/gpu_check.sh
#
# Where the machine lacks rlbus's dependencies (pydantic, pydantic-core, annotated-types, typing-inspection,
# structlog, redis, pyzmq, msgspec: the tests import them through tests/conftest.py; the benchmarks need only
# torch/transformers/safetensors), their wheels can travel in the git-ignored .whl/, fetched beforehand with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VER
# and are installed here into /tmp/site. Without .whl/ the script uses what the machine has installed.
# Each step runs under `timeout`, and the whole script stays within BUDGET_S (default 510 s): a step gets
# min(its own limit, what is left) and is skipped with fewer than 30 s left. Expected wall time ≈ 6 min.
#
# CPU_DRY_RUN=1 checks the script itself without a GPU: --device cpu --preset tiny, no wheel install, the tests
# skip themselves; e.g. `CPU_DRY_RUN=1 PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh` (PYTHON: default python3).

set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-.}"
LOG="$OUT_DIR/gpu_check.log"
BUDGET_S="${BUDGET_S:-510}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
: >"$LOG"
START=$SECONDS
FAILED=()

log() { echo "$@" | tee -a "$LOG"; }

# step NAME LIMIT_S COMMAND...: run under timeout (capped by the budget left), log, record failures.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 30)); then
        log "=== SKIP $name: only ${left}s of the ${BUDGET_S}s budget left"
        FAILED+=("$name(skipped)")
        return
    fi
    ((limit > left)) && limit=$left
    log ""
    log "=== $name (limit ${limit}s, t+$((SECONDS - START))s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    log "=== $name: rc=$rc in $((SECONDS - t0))s"
    ((rc == 0)) || FAILED+=("$name(rc=$rc)")
}

if [[ "${CPU_DRY_RUN:-0}" == 1 ]]; then
    DEV=(--device cpu --preset tiny)
else
    DEV=(--device cuda --preset qwen3-0.6b)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${CPU_DRY_RUN:-0}" != 1 ]] && compgen -G ".whl/*.whl" >/dev/null; then  # a box without the project's deps
    log "=== install wheels from .whl/ into /tmp/site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tee -a "$LOG"; then
        log "=== bulk wheel install failed; installing one by one"
        for whl in .whl/*.whl; do
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                "$whl" 2>&1 | tee -a "$LOG" || FAILED+=("install:$(basename "$whl")")
        done
    fi
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

log "=== machine"
{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv 2>&1 || true
  "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available(), "| transformers", transformers.__version__)'
  nproc; free -g | head -2; df -h /dev/shm /tmp
} 2>&1 | tee -a "$LOG"

# benchmarks/weights.py writes 4 rounds × 2 paths of the weights (≈ 9 GiB for 0.6B) under /dev/shm by default:
# fall back to /tmp when /dev/shm is smaller than that (containers often mount 64 MiB).
SHM_KB=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
WDIR=()
if [[ -z "$SHM_KB" ]] || ((SHM_KB < 12 * 1024 * 1024)); then
    mkdir -p /tmp/rlbus-weights-bench
    WDIR=(--dir /tmp/rlbus-weights-bench)
    log "=== /dev/shm has ${SHM_KB:-?} KiB free: weights benchmark writes to /tmp instead"
fi

step "trainer bench (eager)" 150 "$PY" benchmarks/trainer.py "${DEV[@]}"
step "weights bench (1024 MiB shards)" 90 "$PY" benchmarks/weights.py "${DEV[@]}" "${WDIR[@]}"
step "weights bench (256 MiB shards)" 90 "$PY" benchmarks/weights.py "${DEV[@]}" "${WDIR[@]}" --max-shard-mb 256
step "gpu tests" 150 "$PY" -m pytest tests/trainer/test_gpu.py -q -m gpu -p no:cacheprovider
# The first compiled step took 12–15 s on an H200; warmup 2 = that step + one more, then 5 timed steps.
step "trainer bench (compiled)" 300 "$PY" benchmarks/trainer.py "${DEV[@]}" --compile --only trainer --warmup 2 --steps 5

log ""
log "=== done in $((SECONDS - START))s; failed: ${FAILED[*]:-none}"
((${#FAILED[@]} == 0))
