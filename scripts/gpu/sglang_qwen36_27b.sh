#!/usr/bin/env bash
# The paper's setting through SGLang on one GPU: Qwen3.6-27B (hybrid Gated DeltaNet + attention), a z-lab DFlash
# drafter, budget 64, temperature 1, batch 1 (and 4 and 16 requests in flight): SGLang's plain decoding, its own
# DFLASH on the same drafter, and our DDTREE and WEAVER workers. UNMEASURED: no GPU has run this script yet.
#
#   bash scripts/gpu/sglang_qwen36_27b.sh drafter.path=<z-lab drafter folder or hub id> [more overrides]
#
# The Weaver adapter must exist: `python train.py +experiment=qwen36_27b drafter.path=<same>` trains it (resumable).
# Results: outputs/qwen36_27b/eval/ (rows with backend "sglang"), as for weaver's own engine.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install.sh --serve
python eval.py +experiment=qwen36_27b eval.backend=sglang "eval.methods=[ar,chain,ddtree,weaver]" \
  "eval.budgets=[64]" "eval.sglang.concurrency=[1,4,16]" "$@"
