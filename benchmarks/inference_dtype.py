"""Decode speed of the experiment's target with fp32 and with bf16 weights, side by side in one process.

    python benchmarks/inference_dtype.py +experiment=smollm2
    python benchmarks/inference_dtype.py +experiment=tiny --new-tokens 128
    python benchmarks/inference_dtype.py +experiment=smollm2 --batch 64 --prompt-tokens 100 --new-tokens 32

What `model.dtype: auto` decides for a CPU rests on this: our eager AR decode, batch 1, the same random
prompt, the two dtypes interleaved over --repeats rounds, median tokens/s. With --batch N, N random prompts
decoded together, as the rollouts stage does (what `rollouts.dtype: auto` rests on). Remaining arguments
are Hydra overrides of eval.yaml.
"""

from __future__ import annotations

import argparse
import statistics
import sys

sys.modules.setdefault("fla", None)  # transformers must use its pure-torch GDN path on CPU

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from timing import print_table_header, timed  # noqa: E402

from weaver.generate import generate  # noqa: E402
from weaver.artifacts import load_target_and_tokenizer  # noqa: E402
from weaver.pipeline import ROOT_CONF  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    models = {}
    for name, dtype in DTYPES.items():
        with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
            cfg = compose("eval", overrides=[*overrides, f"model.dtype={dtype}"])
        models[name] = load_target_and_tokenizer(cfg)[0]
    vocab = models["fp32"].cfg.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0)).tolist()
    for model in models.values():
        generate(model, prompts, 4)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            seconds[name].append(timed(lambda: generate(model, prompts, args.new_tokens))[0])
    print(f"{cfg.experiment}: cpu capability {torch.backends.cpu.get_cpu_capability()}, batch {args.batch}, {args.prompt_tokens} "
          f"prompt + {args.new_tokens} new tokens, eager, {args.threads} threads, median of {args.repeats}")
    print_table_header("weights", "tokens/s", "vs fp32")
    fp32 = statistics.median(seconds["fp32"])
    for name, s in seconds.items():
        print(f"| {name} | {args.batch * args.new_tokens / statistics.median(s):.1f} | {fp32 / statistics.median(s):.2f}x |")


if __name__ == "__main__":
    main()
