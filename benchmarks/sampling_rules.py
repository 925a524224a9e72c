"""Sampling rules compared on the same trees: each run decodes the prompts at eval.temperature once, verified by
the first of --rules, and every rule settles each step (its tree, draft distributions and target logits) --coins
times with fresh coins on the way. The table gives each rule's expected accepted drafts per step
over the same steps and the τ that implies (1 + it), its ratio to the first rule's with the standard error of the
paired per-step differences, and its settling time per step.

    python benchmarks/sampling_rules.py +experiment=smollm2_t1 --runs ddtree:4 ddtree:64 weaver:4 weaver:64
    python benchmarks/sampling_rules.py +experiment=tiny_t1 --rules rrs traversal target_only --coins 200

Why paired: two lossless rules sample the same distribution, but an end-to-end evaluation of each samples other
texts, and τ over a few prompts differs by their texts more than by the rules (docs/results.md: "Traversal
verification"). Every rule here sees the trees of one trajectory, so only the rules differ. Those trees were
drawn as the first rule's trajectory met them; a rule that accepts more would have met other states, so read the
figures as each rule's acceptance on the same states, the quantity that τ averages. Runs are method:budget
(a run may set weaver.search for itself, as in benchmarks/spec_decode.py); arguments other than the options are
eval.py overrides (prompt sets, n_prompts, max_new_tokens, ...).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
from hydra import compose, initialize_config_dir
from tqdm.auto import tqdm

from spec_decode import parse_run, with_settings
from timing import print_table_header, write_json
from weaver.acceptance import SAMPLING_RULES
from weaver.data.prompts import eval_prompts
from weaver.eval.run import load_models, speculative_decoder
from weaver.pipeline import ROOT_CONF
from weaver.search import Proposal


class Settlements:
    """Each recorded step settled by every rule `coins` times as it happens (a budget-64 step's logits and draft
    rows take tens of MB, so nothing is kept): per rule, each step's mean accepted drafts and the time taken."""

    def __init__(self, rules: list[str], temperature: float, coins: int):
        self.rules, self.temperature, self.coins = rules, temperature, coins
        self.accepted: dict[str, list[float]] = {rule: [] for rule in rules}
        self.seconds = dict.fromkeys(rules, 0.0)

    def __call__(self, proposal: Proposal, leaf: int, logits: torch.Tensor) -> None:
        step = len(self.accepted[self.rules[0]])
        for rule in self.rules:
            accept, generator = SAMPLING_RULES[rule].accept, torch.Generator().manual_seed(step)
            start = time.perf_counter()
            leaves = [accept(proposal.tree, logits, proposal, self.temperature, generator, None)[0]
                      for _ in range(self.coins)]
            self.seconds[rule] += time.perf_counter() - start
            self.accepted[rule].append(statistics.mean(int(proposal.tree.depth[node]) for node in leaves))


def settle_steps(models, cfg, method: str, budget: int, prompts: list[list[int]], eos: int | None,
                 settlements: Settlements) -> None:
    """Decode `prompts` with eval.sampling, every step settled by every rule on the way."""
    decode = speculative_decoder(models, cfg, method, eos, torch.Generator().manual_seed(cfg.eval.seed),
                                 on_step=settlements)
    for prompt in tqdm(prompts, desc=f"{method}:{budget}", leave=False):
        decode(prompt, budget)


def paired_ratio(base: list[float], other: list[float]) -> tuple[float, float]:
    """(τ of `other` / τ of `base`, the standard error of that ratio from the per-step differences)."""
    tau_base = 1 + statistics.mean(base)
    differences = [b - a for a, b in zip(base, other)]
    error = statistics.stdev(differences) / math.sqrt(len(differences)) if len(differences) > 1 else float("nan")
    return (tau_base + statistics.mean(differences)) / tau_base, error / tau_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["ddtree:16", "weaver:16"])
    parser.add_argument("--rules", nargs="+", default=["rrs", "traversal"], choices=list(SAMPLING_RULES))
    parser.add_argument("--coins", type=int, default=50, help="settlements of each recorded step per rule")
    parser.add_argument("--out", help="write the rows as a JSON list to this file")
    args, overrides = parser.parse_known_args()
    runs = {label: parse_run(label) for label in args.runs}
    if any(budget == "auto" for _, budget, _ in runs.values()):
        sys.exit("--runs need fixed budgets here (method:budget)")
    methods = sorted({method for method, *_ in runs.values()})
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, f"eval.methods=[ar,{','.join(methods)}]",
                                         f"eval.sampling={args.rules[0]}"])
    e = cfg.eval
    if e.temperature <= 0:
        sys.exit("sampling rules settle sampled steps: set eval.temperature > 0")
    models, tokenizer = load_models(cfg)
    prompts = [p for ids in eval_prompts(cfg, tokenizer).values() for p in ids]
    print(f"{cfg.experiment}: {len(prompts)} prompts x {e.max_new_tokens} new tokens, temperature {e.temperature}, "
          f"trees verified by {args.rules[0]}, {args.coins} settlements per step and rule, "
          f"cpu {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print_table_header("run", "rule", "steps", "accepted drafts / step", "τ", f"vs {args.rules[0]} (± s.e.)", "ms / step")
    rows = []
    for label, (method, budget, settings) in runs.items():
        settled = Settlements(args.rules, e.temperature, args.coins)
        settle_steps(models, with_settings(cfg, settings), method, budget, prompts, tokenizer.eos_token_id, settled)
        base = settled.accepted[args.rules[0]]
        for rule, means in settled.accepted.items():
            ratio, error = paired_ratio(base, means)
            seconds = settled.seconds[rule] / (len(means) * args.coins)
            rows.append({"run": label, "method": method, "budget": budget, "rule": rule, "steps": len(means),
                         "accepted": statistics.mean(means), "tau": 1 + statistics.mean(means), "vs_first": ratio,
                         "vs_first_se": error, "seconds_per_step": seconds})
            r = rows[-1]
            print(f"| {label} | {rule} | {len(means)} | {r['accepted']:.3f} | {r['tau']:.3f} | {ratio:.3f} (± {error:.3f}) | "
                  f"{1000 * seconds:.2f} |")
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
