#!/usr/bin/env bash
# Qwen3-8B (attention only) with z-lab's DFlash drafter through SGLang on one GPU, greedy, budgets 16 and 64,
# 1, 4 and 16 requests in flight: SGLang's plain decoding, its own DFLASH on the same drafter, and our DDTREE and
# WEAVER workers. UNMEASURED: no GPU has run this script yet.
#
#   bash scripts/gpu/sglang_qwen3_8b.sh [overrides, e.g. model.path=<local folder> drafter.path=<local folder>]
#
# The Weaver adapter must exist: `python train.py +experiment=qwen3_8b` trains it (resumable).
# Results: outputs/qwen3_8b/eval/ (rows with backend "sglang"), as for weaver's own engine.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install.sh --serve
python eval.py +experiment=qwen3_8b eval.backend=sglang "eval.methods=[ar,chain,ddtree,weaver]" \
  "eval.budgets=[16,64]" "eval.sglang.concurrency=[1,4,16]" "$@"
