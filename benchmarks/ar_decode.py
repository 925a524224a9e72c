"""Our autoregressive decode vs transformers' `generate`, same weights, same prompt, one process.

    python benchmarks/ar_decode.py --model outputs/artifacts/target-<key>   # any HF folder
    python benchmarks/ar_decode.py --experiment tiny                        # the pipeline's target
    python benchmarks/ar_decode.py --experiment tiny --compile max-autotune # frozen weights, autotuned matmuls

Both decode greedily, batch 1, for --new-tokens tokens (eos ignored); each is run --repeats times,
alternating, and the medians are compared. The token sequences must be identical (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys

sys.modules.setdefault("fla", None)  # transformers must use its pure-torch GDN path on CPU

import torch  # noqa: E402
from timing import print_table_header, timed  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from weaver.generate import generate  # noqa: E402
from weaver.models.checkpoint import load_target  # noqa: E402
from weaver.models.compile import INDUCTOR_MODES  # noqa: E402


def time_ours(model, prompt: list[int], new_tokens: int, compiled: bool = False) -> tuple[float, list[int]]:
    return timed(lambda: generate(model, [prompt], new_tokens, compiled=compiled)[0])


@torch.inference_mode()
def time_transformers(model, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    seconds, out = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))
    return seconds, out[0, len(prompt):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF checkpoint folder")
    source.add_argument("--experiment", help="take the target artifact of this train experiment")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", default="default", choices=sorted(INDUCTOR_MODES), help="inductor mode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or experiment_target(args.experiment)

    ours = load_target(folder)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    theirs.generation_config.eos_token_id = None  # decode exactly --new-tokens tokens
    prompt = torch.randint(3, ours.cfg.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    warm_up = timed(lambda: (time_ours(ours, prompt, 8), time_ours(ours, prompt, 8, compiled=args.compile),
                             time_transformers(theirs, prompt, 8)))[0]
    print(f"warm-up (includes torch.compile of our decode step): {warm_up:.0f} s")
    seconds: dict[str, list[float]] = {"eager": [], "compiled": [], "transformers": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit all three alike
        for name in seconds:
            timer = time_transformers if name == "transformers" else time_ours
            extra = {"compiled": args.compile} if name == "compiled" else {}
            t, tokens[name] = timer(ours if name != "transformers" else theirs, prompt, args.new_tokens, **extra)
            seconds[name].append(t)
    tps = {name: args.new_tokens / statistics.median(s) for name, s in seconds.items()}
    same = tokens["eager"] == tokens["compiled"] == tokens["transformers"]
    print(f"model {folder} ({ours.cfg.model_type}, {sum(p.numel() for p in ours.parameters()) / 1e6:.2f}M params), "
          f"batch 1, {args.prompt_tokens} prompt + {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.repeats}")
    print_table_header("decoder", "tokens/s", "ms/token", "vs transformers")
    for name, label in [("eager", "weaver, eager"), ("compiled", f"weaver, torch.compile ({args.compile})"), ("transformers", "transformers generate")]:
        print(f"| {label} | {tps[name]:.1f} | {1000 / tps[name]:.2f} | {tps[name] / tps['transformers']:.2f}x |")
    print(f"identical greedy tokens (all three): {same}")
    if not same:
        sys.exit("greedy outputs differ")


def experiment_target(experiment: str) -> str:
    from hydra import compose, initialize_config_dir

    from weaver.pipeline import ROOT_CONF, artifact_dir

    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"+experiment={experiment}"])
    return str(artifact_dir(cfg, "target"))


if __name__ == "__main__":
    main()
