"""Speculative decoding speed, side by side in one process: our AR decode (the eval baseline, compiled
unless eval.compile=false) and each method@budget on the same prompts, interleaved over --repeats rounds
so that drifts in machine load hit all of them alike; medians over rounds.

    python benchmarks/spec_decode.py +experiment=tiny --runs chain:15 ddtree:16 weaver:8 weaver:16
    python benchmarks/spec_decode.py +experiment=tiny eval.datasets=[humaneval] eval.n_prompts=4

Arguments other than the options are eval.py overrides (prompt sets, n_prompts, max_new_tokens, ...).
A round decodes every prompt of every dataset once per run. The table gives the median tokens/s, the
median of the per-round ratios to AR and to the first --runs entry (the baseline), and τ. At temperature
0 every run's tokens must equal eager greedy AR decoding's (checked; the timed AR may be compiled).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from hydra import compose, initialize_config_dir
from tqdm.auto import tqdm

from weaver.data.prompts import encode_prompts, load_prompt_set, template_kwargs
from weaver.eval.run import load_models, run_ar, run_speculative, warm_up
from weaver.pipeline import ROOT_CONF


def parse_run(text: str) -> tuple[str, int]:
    method, _, budget = text.partition(":")
    if not budget.isdigit():
        raise SystemExit(f"--runs entries are method:budget (e.g. weaver:8), got '{text}'")
    return method, int(budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["chain:15", "ddtree:16", "weaver:8", "weaver:16"])
    parser.add_argument("--repeats", type=int, default=5)
    args, overrides = parser.parse_known_args()
    runs = {label: parse_run(label) for label in args.runs}
    methods = sorted({method for method, _ in runs.values()})
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, f"eval.methods=[ar,{','.join(methods)}]"])
    e = cfg.eval
    models, tokenizer = load_models(cfg)
    eos = tokenizer.eos_token_id
    warm_up(models, cfg, eos or 0)
    prompts = [p for name in e.datasets
               for p in encode_prompts(load_prompt_set(cfg, name), tokenizer, e.n_prompts, e.prompt_tokens, e.long_prompts,
                                      template_kwargs(cfg))]

    speed: dict[str, list[float]] = {label: [] for label in ["ar", *runs]}
    tau: dict[str, float] = {"ar": 1.0}
    for _ in tqdm(range(args.repeats), desc="rounds"):
        ar = run_ar(models, prompts, cfg, eos)
        speed["ar"].append(ar["tokens_per_s"])
        for label, (method, budget) in runs.items():
            result = run_speculative(models, prompts, cfg, eos, method, budget)
            if e.temperature == 0 and result["outputs"] != ar["reference"]:
                sys.exit(f"{label}: greedy tokens differ from AR decoding")
            speed[label].append(result["tokens_per_s"])
            tau[label] = result["tau"]

    baseline = args.runs[0]

    def median_ratio(label: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(speed[label], speed[base]))

    print(f"{cfg.experiment}: {len(prompts)} prompts ({', '.join(e.datasets)}) x {e.max_new_tokens} new tokens, "
          f"temperature {e.temperature}, AR {'compiled' if e.compile else 'eager'}, median of {args.repeats} rounds")
    print(f"| run | τ | tokens/s | vs AR | vs {baseline} |")
    print("|---|---|---|---|---|")
    for label in speed:
        print(f"| {label} | {tau[label]:.2f} | {statistics.median(speed[label]):.1f} | {median_ratio(label, 'ar'):.2f}x "
              f"| {median_ratio(label, baseline):.2f}x |")


if __name__ == "__main__":
    main()
