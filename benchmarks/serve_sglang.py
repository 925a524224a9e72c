"""Greedy decoding through SGLang's offline engine: plain, then our WEAVER / DDTREE workers on the same
requests; per method τ ((verify steps + drafts accepted) / verify steps), drafts accepted, wall time, and whether the
output equals plain decoding. (`eval.py eval.backend=sglang` measures the eval's prompt sets the same way.) Runs in the SGLang environment (`bash scripts/install.sh --serve`):

    .venv-sglang/bin/python benchmarks/serve_sglang.py --target DIR --drafter DIR [--adapter DIR] \\
        [--draft-tokens 5] [--max-new-tokens 48] [--prompt-ids FILE] [--cpu-stand-ins tests/serving_sglang/cpu_engine] \\
        [--out FILE]

Prompts: three chat requests through the target's chat template, or token ids from --prompt-ids (JSON list of
lists).

On a CPU, SGLang needs the CPU build of sgl_kernel; `--cpu-stand-ins` puts our test-side stand-ins for it
on the path (README, "Serving with SGLang"); their Python loops, not SGLang, then bound the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from timing import write_json
from weaver.serving.sglang.runs import CPU_ENGINE, run_engine, stand_ins_environment

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 times 23? Explain step by step.",
    "List three uses of a hash map and explain each briefly.",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF checkpoint folder of the target (with its tokenizer)")
    p.add_argument("--drafter", required=True, help="our drafter (DFlash format)")
    p.add_argument("--adapter", help="our Weaver adapter; without it only DDTREE runs")
    p.add_argument("--draft-tokens", type=int, default=5, help="tree size with its root (budget + 1)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-ids", help="JSON file: a list of prompts as token ids (default: three chat requests)")
    p.add_argument("--cpu-stand-ins", help="folder with the stand-ins for SGLang's CPU kernels (CPU only)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args()


def chat_prompts(target: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for q in PROMPTS]


def run(args: argparse.Namespace, algorithm: str | None, prompts: list[list[int]]) -> dict:
    """One engine (`weaver.serving.sglang.runs`), the prompts one at a time."""
    spec = {"target": args.target, "algorithm": algorithm, "drafter": args.drafter,
            "num_draft_tokens": args.draft_tokens, "batches": [[p] for p in prompts],
            "max_new_tokens": args.max_new_tokens, "engine": CPU_ENGINE if args.cpu_stand_ins else {},
            "env": {"WEAVER_ADAPTER": args.adapter} if algorithm == "WEAVER" else {}}
    batches = run_engine(spec)
    seconds = sum(b["seconds"] for b in batches)
    steps, drafts = sum(b["steps"][0] for b in batches), sum(b["drafts"][0] for b in batches)
    tokens = sum(len(b["ids"][0]) for b in batches)
    return {"method": algorithm or "plain", "ids": [b["ids"][0] for b in batches], "seconds": seconds,
            "tokens_per_s": tokens / seconds, "tau": (steps + drafts) / steps if steps else 1.0, "drafts_accepted": drafts}


def main() -> None:
    args = parse_args()
    if args.cpu_stand_ins:
        os.environ.update(stand_ins_environment(args.cpu_stand_ins))
        sys.path.insert(0, str(Path(args.cpu_stand_ins).resolve()))
    prompts = json.loads(Path(args.prompt_ids).read_text()) if args.prompt_ids else chat_prompts(args.target)
    results = [run(args, None, prompts)]
    results += [run(args, name, prompts) for name in ("DDTREE", "WEAVER") if name == "DDTREE" or args.adapter]
    print(f"{'method':8} {'tau':>5} {'drafts':>6} {'tok/s':>7} {'vs plain':>8}  output = plain")
    for r in results:
        print(f"{r['method']:8} {r['tau']:5.2f} {r['drafts_accepted']:6d} {r['tokens_per_s']:7.2f} "
              f"{r['tokens_per_s'] / results[0]['tokens_per_s']:7.2f}x  {r['ids'] == results[0]['ids']}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
