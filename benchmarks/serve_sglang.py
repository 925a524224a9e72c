"""Greedy decoding through SGLang's offline engine: plain, then our WEAVER / DDTREE workers on the same
requests; per method τ (tokens per verify step), drafts accepted, wall time, and whether the output equals
plain decoding. Runs in the SGLang environment (`bash scripts/install.sh --serve`):

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
import time
from pathlib import Path

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
    import sglang as sgl

    device = (dict(device="cpu", attention_backend="torch_native", dtype="float32", mem_fraction_static=0.3,
                   max_total_tokens=8192) if args.cpu_stand_ins else {})
    spec = {} if algorithm is None else dict(speculative_algorithm=algorithm, speculative_draft_model_path=args.drafter,
                                             speculative_num_draft_tokens=args.draft_tokens)
    engine = sgl.Engine(model_path=args.target, skip_tokenizer_init=True, disable_cuda_graph=True, log_level="error",
                        **device, **spec)
    try:
        start = time.perf_counter()
        outputs = [engine.generate(input_ids=[p], sampling_params={"max_new_tokens": args.max_new_tokens,
                                                                   "temperature": 0})[0] for p in prompts]
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = sum(len(o["output_ids"]) for o in outputs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
    return {"method": algorithm or "plain", "ids": [o["output_ids"] for o in outputs], "seconds": seconds,
            "tokens_per_s": tokens / seconds, "tau": tokens / steps if steps else 1.0,
            "drafts_accepted": sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outputs)}


def main() -> None:
    args = parse_args()
    if args.cpu_stand_ins:  # read by SGLang at import, and by the scheduler processes it spawns
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(args.cpu_stand_ins).resolve()),
                                                                 os.environ.get("PYTHONPATH")]))
        sys.path.insert(0, str(Path(args.cpu_stand_ins).resolve()))
    if args.adapter:
        os.environ["WEAVER_ADAPTER"] = args.adapter
    prompts = json.loads(Path(args.prompt_ids).read_text()) if args.prompt_ids else chat_prompts(args.target)
    results = [run(args, None, prompts)]
    results += [run(args, name, prompts) for name in ("DDTREE", "WEAVER") if name == "DDTREE" or args.adapter]
    print(f"{'method':8} {'tau':>5} {'drafts':>6} {'tok/s':>7} {'vs plain':>8}  output = plain")
    for r in results:
        print(f"{r['method']:8} {r['tau']:5.2f} {r['drafts_accepted']:6d} {r['tokens_per_s']:7.2f} "
              f"{r['tokens_per_s'] / results[0]['tokens_per_s']:7.2f}x  {r['ids'] == results[0]['ids']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
