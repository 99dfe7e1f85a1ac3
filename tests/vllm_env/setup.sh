#!/usr/bin/env bash
# Build a SEPARATE CPU venv in which vLLM's own drafter-loading code runs, for
# tests/integration/test_vllm_load.py (see ../shared/design/VLLM_ON_CPU.md).
#
# Never lets pip resolve vLLM's dependencies (that pulls a ~9 GB CUDA torch):
# vLLM, xgrammar and apache-tvm-ffi are installed with --no-deps, everything
# else is a short list of pure-Python packages pinned next to torch 2.13.0 (CPU).
# About 2-4 minutes and ~2.2 GB.
#
# Usage:  bash tests/vllm_env/setup.sh [VENV_DIR]      (default /work/vllm-venv)
# Then:   cd /work/main && PYTHONPATH=. VENV_DIR/bin/pytest -q tests/integration/test_vllm_load.py
set -euo pipefail

VENV=${1:-/work/vllm-venv}
PY=${PYTHON:-python3.11}
WHEELS=${VLLM_WHEEL_DIR:-$(dirname "$VENV")/.vllm-wheels}

"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip setuptools wheel

# 1. torch first (the CPU wheel), then pin it for every later step.
"$PIP" install -q "torch==2.13.0"
CONSTRAINTS=$(mktemp)
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$CONSTRAINTS"
trap 'rm -f "$CONSTRAINTS"' EXIT

# 2. vLLM itself, without dependencies (a CUDA wheel; none of its compiled code is loaded).
mkdir -p "$WHEELS"
ls "$WHEELS"/vllm-0.33.0-*.whl >/dev/null 2>&1 || "$PIP" download -q --no-deps "vllm==0.33.0" -d "$WHEELS"
"$PIP" install -q --no-deps "$WHEELS"/vllm-0.33.0-*.whl
"$PIP" install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"

# 3. The pure-Python packages vLLM's import path needs (torch stays pinned).
"$PIP" install -q -c "$CONSTRAINTS" \
  "transformers>=5.16.1,<5.21.0" safetensors numpy pydantic cachetools psutil regex msgspec \
  pyyaml cloudpickle blake3 py-cpuinfo requests tqdm sentencepiece einops pyzmq cbor2 pybase64 \
  aiohttp openai oss-harmony "pillow>=13" uvloop prometheus_client "fastapi<0.137" \
  partial-json-parser llguidance "compressed-tensors==0.17.0"

# 4. This project's own test needs (no datasets/accelerate: the vLLM load test does not use them).
"$PIP" install -q -c "$CONSTRAINTS" "huggingface_hub" "pytest>=8"

# 5. Smoke check: vLLM imports on CPU and our package imports next to it.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
