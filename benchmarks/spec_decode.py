"""Speculative decoding speed, side by side in one process: our AR decode (the eval baseline, compiled
unless eval.compile=false, same dtype and threads) and each method@budget on the same prompts, interleaved
prompt by prompt (their order rotated from prompt to prompt) over --repeats rounds, so that drifts in machine
load hit all of them alike; medians over rounds.

    python benchmarks/spec_decode.py +experiment=tiny --runs chain:15 ddtree:16 weaver:8 weaver:auto
    python benchmarks/spec_decode.py +experiment=tiny --runs ddtree:8 weaver:8 weaver:8:rescore=4
    python benchmarks/spec_decode.py +experiment=smollm2 --best --out outputs/smollm2/speed.json eval.n_prompts=2

--best sweeps every budget of eval.budgets (and the chain's block, plus `auto` where eval.budgets has it)
for each of --methods and marks each method's best. A run may set weaver.search for itself
(weaver:8:rescore=4,nodes_per_call=2), eval.auto_budget for itself (ddtree:auto:stepwise=1), or, at temperature > 0,
its acceptance rule (ddtree:4:sampling=traversal; default eval.sampling) and fixed children per node
(ddtree:8:fixed_children=2; default eval.fixed_children), so that settings are compared in one
process. Arguments other than the options are eval.py
overrides (prompt sets, n_prompts, max_new_tokens, ...). A round decodes every prompt of every dataset
once per run (each run's generator and `auto` planner carried from prompt to prompt, fresh each round). The
table gives τ, median tokens/s, the medians of the per-round ratios to AR (their range in brackets) and to the
chain (the chain's best run), efficiency (speedup over AR / τ: the share of τ that reaches wall-clock), and
where a decode's time goes (`weaver.engine.PHASES`: the prompt's prefill, then the steps' phases; other = the loop's
bookkeeping). At
temperature 0 every run's tokens must equal eager greedy AR decoding's (checked; the timed AR may be compiled).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from timing import write_json
from weaver.acceptance import SAMPLING_RULES
from weaver.data.prompts import eval_prompts
from weaver.eval.run import (SHARES, ar_decoder, ar_summary, greedy_reference, interleaved_round, load_models, method_spec,
                             speculative_run, speculative_summary, warm_up)
from weaver.pipeline import ROOT_CONF


def parse_run(text: str) -> tuple[str, int | str, dict[str, int | str]]:
    """method:budget[:setting=value,...], settings of weaver.search or eval.auto_budget (whole numbers) or the
    acceptance rule (sampling=<rule>) for this run only."""
    method, _, rest = text.partition(":")
    budget, _, listed = rest.partition(":")
    settings = dict(item.partition("=")[::2] for item in listed.split(",") if item)
    rule = settings.pop("sampling", None)
    if (not (budget.isdigit() or budget == "auto") or not all(v.isdigit() for v in settings.values())
            or (rule is not None and rule not in SAMPLING_RULES)):
        raise SystemExit(f"--runs entries are method:budget[:setting=N,...] (e.g. weaver:8, weaver:auto or "
                         f"weaver:4:rescore=4), or :sampling=<{'|'.join(SAMPLING_RULES)}>, got '{text}'")
    return method, int(budget) if budget.isdigit() else budget, {
        **{k: int(v) for k, v in settings.items()}, **({"sampling": rule} if rule else {})}


def with_settings(cfg: DictConfig, settings: dict[str, int | str]) -> DictConfig:
    """cfg with a run's own settings: eval.auto_budget's by their names (stepwise=1 compares `auto`'s planners
    in one process), `sampling` and `fixed_children` as eval's, the rest weaver.search's (unknown names are
    refused by the config's schema)."""
    if not settings:
        return cfg
    auto = {k: v for k, v in settings.items() if k in cfg.eval.auto_budget}
    rule = {k: v for k, v in settings.items() if k in ("sampling", "fixed_children")}
    search = {k: v for k, v in settings.items() if k not in auto and k not in rule}
    return OmegaConf.merge(cfg, {"weaver": {"search": search}, "eval": {"auto_budget": auto, **rule}})


def round_ratios(speed: dict[str, list[float]], label: str, base: str) -> list[float]:
    return [a / b for a, b in zip(speed[label], speed[base])]


def median_ratios(speed: dict[str, list[float]], label: str, base: str) -> float:
    return statistics.median(round_ratios(speed, label, base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["chain:15", "ddtree:16", "weaver:8", "weaver:16"])
    parser.add_argument("--best", action="store_true", help="sweep each of --methods over the eval budgets")
    parser.add_argument("--methods", nargs="+", default=["chain", "ddtree", "weaver"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the rows as a JSON list to this file")
    args, overrides = parser.parse_known_args()
    methods = args.methods if args.best else sorted({parse_run(r)[0] for r in args.runs})
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, f"eval.methods=[ar,{','.join(methods)}]"])
    e = cfg.eval
    models, tokenizer = load_models(cfg)
    runs = ({f"{m}:{b}": (m, b, {}) for m in methods for b in method_spec(m).budgets(cfg, models)} if args.best
            else {label: parse_run(label) for label in args.runs})
    eos, block = tokenizer.eos_token_id, models["drafter"].cfg.block_size
    warm_up(models, cfg, eos or 0, [(method, budget) for method, budget, _ in runs.values()])
    prompts = [p for ids in eval_prompts(cfg, tokenizer).values() for p in ids]
    for method, budget, settings in runs.values():  # a run's own settings may compile other graphs
        if settings:
            speculative_run(models, with_settings(cfg, settings), eos, method, budget)(prompts[0])

    reference = greedy_reference(models, prompts, cfg, eos) if e.temperature == 0 else None
    speed: dict[str, list[float]] = {label: [] for label in ["ar", *runs]}
    results: dict[str, list[dict]] = {label: [] for label in runs}
    for round_ in tqdm(range(args.repeats), desc="rounds"):
        decoders = {"ar": ar_decoder(models, cfg, eos), **{label: speculative_run(models, with_settings(cfg, settings), eos, method, budget)
                                                          for label, (method, budget, settings) in runs.items()}}
        done = interleaved_round(decoders, prompts, shift=round_)
        for label, (outputs, stats, seconds) in done.items():
            result = ar_summary(outputs, seconds) if label == "ar" else speculative_summary(outputs, stats, seconds, block)
            if reference is not None and label != "ar" and outputs != reference:
                sys.exit(f"{label}: greedy tokens differ from eager AR decoding")
            speed[label].append(result["tokens_per_s"])
            if label != "ar":
                results[label].append(result)

    chains = [label for label, (method, *_) in runs.items() if method == "chain"]
    chain = max(chains, key=lambda label: statistics.median(speed[label])) if chains else None
    best = {method: max((label for label, (m, *_) in runs.items() if m == method), key=lambda label: statistics.median(speed[label]))
            for method in {m for m, *_ in runs.values()}}
    rows = [{"run": "ar", "method": "ar", "budget": None, "tau": 1.0, "tokens_per_s": statistics.median(speed["ar"]),
             "vs_ar": 1.0, "vs_chain": median_ratios(speed, "ar", chain) if chain else None, "efficiency": 1.0}]
    for label, (method, budget, _) in runs.items():
        vs_ar, tau = median_ratios(speed, label, "ar"), statistics.median(r["tau"] for r in results[label])
        rows.append({
            "run": label, "method": method, "budget": budget, "tau": tau, "tokens_per_s": statistics.median(speed[label]),
            "vs_ar": vs_ar, "vs_ar_rounds": round_ratios(speed, label, "ar"),
            "vs_chain": median_ratios(speed, label, chain) if chain else None, "efficiency": vs_ar / tau,
            "best": best[method] == label, "mean_budget": statistics.median(r["mean_budget"] for r in results[label]),
            "budget_steps": dict(sum((Counter(r["budget_steps"]) for r in results[label]), Counter())),
            **{k: statistics.median(r[k] for r in results[label]) for k in SHARES},
        })

    print(f"{cfg.experiment}: {len(prompts)} prompts ({', '.join(e.datasets)}) x {e.max_new_tokens} new tokens, "
          f"temperature {e.temperature}, AR {f'compiled ({e.compile})' if e.compile else 'eager'}, median of {args.repeats} rounds, "
          f"cpu {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print("| run | τ | tokens/s | vs AR | vs chain | efficiency | " + " | ".join(k.removesuffix("_share") for k in SHARES) + " |")
    print("|---" * (6 + len(SHARES)) + "|")
    for r in rows:
        name = f"**{r['run']}**" if r.get("best") and args.best else r["run"]
        if r["budget"] == "auto":
            steps = sum(r["budget_steps"].values())
            mix = ", ".join(f"{b}: {n / steps:.0%}" for b, n in sorted(r["budget_steps"].items()))
            name += f" (mean budget {r['mean_budget']:.1f}; steps at {mix})"
        split = " | ".join(f"{r[k]:.0%}" if k in r else "" for k in SHARES)
        vs_chain = f"{r['vs_chain']:.2f}x" if r["vs_chain"] is not None else "-"
        spread = f" ({min(r['vs_ar_rounds']):.2f}-{max(r['vs_ar_rounds']):.2f})" if len(r.get("vs_ar_rounds", [])) > 1 else ""
        print(f"| {name} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_ar']:.2f}x{spread} | {vs_chain} | "
              f"{r['efficiency']:.2f} | {split} |")
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
