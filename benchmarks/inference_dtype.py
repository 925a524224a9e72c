"""Decode speed of the experiment's target with fp32 and with bf16 weights, side by side in one process.

    python benchmarks/inference_dtype.py +experiment=smollm2
    python benchmarks/inference_dtype.py +experiment=tiny --new-tokens 128
    python benchmarks/inference_dtype.py +experiment=smollm2 --batch 64 --prompt-tokens 100 --new-tokens 32
    python benchmarks/inference_dtype.py +experiment=smollm2 --agreement 5
    python benchmarks/inference_dtype.py +experiment=smollm2 --compiled --agreement 5

What `model.dtype: auto` decides for a CPU rests on this: our eager (--compiled: compiled) AR decode, batch 1, the
same random prompt, the settings interleaved over --repeats rounds, median tokens/s. Three settings: fp32; bf16 as
eval.py runs it, made exact (on a CPU the math between matmuls in float64 and matmuls in fixed-size calls, so
that a verify pass rounds as decoding does: weaver.models.layers.exact_math); and "bf16, fast kernels", the same
weights without that (`exact_bf16(False)`, as the data stages run), which is what exactness costs. With --batch N,
N random prompts decoded together, as the rollouts stage does (what `rollouts.dtype: auto` rests on). With
--agreement K, also how often each dtype's greedy token changes with the shape of the forward: the eval prompts
(eval.datasets, eval.n_prompts) are decoded greedily one token at a time, then the same tokens are read again K at
a time, as a verify pass of a K-node chain reads them; a position whose argmax differs is one where speculative
decoding would leave AR decoding's output (fp32 and exact bf16 should show none).
Remaining arguments are Hydra overrides of eval.yaml.
"""

from __future__ import annotations

import argparse
import statistics
import sys

sys.modules.setdefault("fla", None)  # transformers must use its pure-torch GDN path on CPU

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from timing import print_table_header, timed  # noqa: E402

from weaver.artifacts import load_target_and_tokenizer  # noqa: E402
from weaver.data.prompts import eval_prompts  # noqa: E402
from weaver.generate import generate  # noqa: E402
from weaver.models.linear import exact_bf16  # noqa: E402
from weaver.models.target import TargetModel  # noqa: E402
from weaver.pipeline import ROOT_CONF  # noqa: E402

SETTINGS = {"fp32": ("float32", True), "bf16": ("bfloat16", True), "bf16, fast kernels": ("bfloat16", False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--agreement", type=int, default=0, metavar="K",
                        help="also compare greedy decoding with K-token forwards over the eval prompts")
    parser.add_argument("--compiled", action="store_true", help="time the compiled decode step (eval.py's AR baseline)")
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    weights = {}
    for dtype in {dtype for dtype, _ in SETTINGS.values()}:
        with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
            cfg = compose("eval", overrides=[*overrides, f"model.dtype={dtype}"])
        weights[dtype], tokenizer = load_target_and_tokenizer(cfg)
    models = {name: (weights[dtype], exact) for name, (dtype, exact) in SETTINGS.items()}
    vocab = weights["float32"].cfg.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0)).tolist()

    def decode(name: str, n: int) -> None:
        model, exact = models[name]
        with exact_bf16(exact):
            generate(model, prompts, n, compiled=args.compiled)

    for name in models:
        decode(name, 4)  # warm-up (and compilation)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name in models:
            seconds[name].append(timed(lambda: decode(name, args.new_tokens))[0])
    print(f"{cfg.experiment}: cpu capability {torch.backends.cpu.get_cpu_capability()}, batch {args.batch}, {args.prompt_tokens} "
          f"prompt + {args.new_tokens} new tokens, {'compiled' if args.compiled else 'eager'}, {args.threads} threads, "
          f"median of {args.repeats}")
    print_table_header("weights", "tokens/s", "vs fp32")
    fp32 = statistics.median(seconds["fp32"])
    for name, s in seconds.items():
        print(f"| {name} | {args.batch * args.new_tokens / statistics.median(s):.1f} | {fp32 / statistics.median(s):.2f}x |")
    if args.agreement:
        prompts = [p for ids in eval_prompts(cfg, tokenizer).values() for p in ids]
        print(f"\ngreedy tokens decoded one at a time against the same tokens read {args.agreement} at a time, "
              f"{len(prompts)} eval prompts x {args.new_tokens} new tokens, eager")
        print_table_header("weights", "positions whose argmax differs", "answers that would differ")
        for name, (model, exact) in models.items():
            with exact_bf16(exact):
                flips = [argmax_flips(model, prompt, args.new_tokens, args.agreement) for prompt in prompts]
            total = sum(n for _, n in flips)
            print(f"| {name} | {sum(f for f, _ in flips)} of {total} | {sum(f > 0 for f, _ in flips)} of {len(prompts)} |")


@torch.no_grad()
def argmax_flips(model: TargetModel, prompt: list[int], new_tokens: int, chunk: int) -> tuple[int, int]:
    """(positions whose argmax differs, positions) between greedy decoding of `prompt` and re-reading its
    answer `chunk` tokens per forward after the prompt's prefill."""
    answer = generate(model, [prompt], new_tokens)[0]
    ids = torch.tensor([prompt + answer], device=model.embed.weight.device)
    cache = model.new_cache(1, ids.shape[1])
    logits = [model(ids[:, :len(prompt)], cache, logits_to_keep=1).logits[0]]
    for start in range(len(prompt), ids.shape[1] - 1, chunk):
        logits.append(model(ids[:, start:min(start + chunk, ids.shape[1] - 1)], cache).logits[0])
    reread = torch.cat(logits).argmax(-1).cpu()
    return int((reread != torch.tensor(answer)).sum()), len(answer)


if __name__ == "__main__":
    main()
