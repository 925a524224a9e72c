"""`budget: auto` replayed offline: how far the planner's choices fall from the best fixed budget, and why.

    python benchmarks/budget_replay.py +experiment=smollm2_read --method ddtree eval.n_prompts=2
    python benchmarks/budget_replay.py +experiment=smollm2_read eval.n_prompts=2 --method weaver --explore-every 4 8 --decay 0.9 0.95

Each eval prompt is decoded once with every step at the largest candidate of eval.auto_budget (the anytime
search `auto` uses), recording each step's accepted path. A tree of budget b is the first b nodes of that tree
(weaver/budget.py), so every step shows what every candidate would have accepted. The planner is then replayed
over those steps, in the eval's prompt order, for each --explore-every x --decay, with the start-up probe's step
costs (`step_costs`, measured here as eval.py measures them) as the price of each step; the table compares its
expected tokens per second with each fixed candidate's, and prints the planner's estimates of the accepted drafts
at the end of each prompt against the prompt's own means. Replayed steps keep the recorded trajectory (a budget
that accepts less would have led elsewhere): a statistical replay, not a decode. Arguments other than the options
are eval.py overrides (before the options that take several values). `--paths FILE.json` keeps the recording
(steps and step costs) to replay planner settings without decoding again: read when FILE exists, else written.
`--orders N` also replays the prompts in N - 1 seeded shuffled orders (one trajectory is one draw of the planner's
noise: the spread says how far a setting's lead is luck). Two reference rows say where the rest goes: the planner
told the recording's mean accepted drafts (what its exploration alone costs) and each prompt at its own best fixed
budget (what following the prompt could gain over the best single budget). `--candidates 1,2,4 1,3,7` replays
the planner choosing among each listed subset of the recorded candidates (record with their union in
eval.auto_budget.candidates), every rate against the best fixed budget of the whole recording: which candidate
list serves `auto` best on this machine. The recording also keeps each step's
path probabilities (`Proposal.path_probs` of the tree's nodes), so the stepwise planner (`StepwisePlanner`: each
step's budget from its own tree, opt-in for greedy chains and DDTrees: eval.auto_budget.stepwise) is replayed
beside it, priced by the probe's costs of its own steps (which build the largest candidate's tree and verify its
first b nodes).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import statistics
from collections import Counter
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from timing import print_table_header

from weaver.budget import BudgetPlanner, StepwisePlanner
from weaver.data.prompts import eval_prompts
from weaver.eval.run import auto_candidates, load_models, speculative_decoder, step_costs
from weaver.io import atomic_write_json
from weaver.pipeline import ROOT_CONF

Steps = list[tuple[str, list[list[int]]]]  # per prompt: its dataset and each step's accepted tree nodes
Expected = list[list[list[float]]]  # per prompt and step: expected accepted drafts within the tree's first 1, 2, ... nodes


def record_paths(models, tokenizer, cfg, method: str, largest: dict[int, float]) -> tuple[Steps, Expected]:
    """Every step's accepted path (tree nodes, anchor excluded) with the anytime search at the largest budget
    (`largest`: that budget and its step cost), and the step's expected accepted drafts by its path probabilities."""
    e, recorded, expected_steps = cfg.eval, [], []
    for name, prompts in eval_prompts(cfg, tokenizer).items():
        for prompt in prompts:
            paths: list[list[int]] = []
            expected: list[list[float]] = []

            def on_step(proposal, leaf, logits):
                paths.append(proposal.tree.path_to(leaf)[1:].tolist())
                expected.append([round(x, 5) for x in proposal.path_probs()[1:].cumsum(0).tolist()])

            decode = speculative_decoder(models, cfg, method, tokenizer.eos_token_id, torch.Generator().manual_seed(e.seed),
                                         on_step=on_step)
            decode(prompt, BudgetPlanner(largest))  # one candidate: every step at it, built as `auto` builds trees
            recorded.append((name, paths))
            expected_steps.append(expected)
    return recorded, expected_steps


def accepted(path: list[int], budget: int) -> int:
    return sum(1 for node in path if node <= budget)


def fixed_rate(steps: Steps, costs: dict[int, float], budget: int) -> float:
    """Expected committed tokens per second of a fixed budget over the recorded steps."""
    paths = [p for _, prompt in steps for p in prompt]
    return sum(1 + accepted(p, budget) for p in paths) / (costs[budget] * len(paths))


def prompt_oracle_rate(steps: Steps, costs: dict[int, float]) -> float:
    """Expected tokens per second with each prompt at its own best fixed budget: what following the prompt could give."""
    tokens = seconds = 0.0
    for _, prompt in steps:
        budget = max(costs, key=lambda b: fixed_rate([("", prompt)], costs, b))
        tokens += sum(1 + accepted(p, budget) for p in prompt)
        seconds += costs[budget] * len(prompt)
    return tokens / seconds


class KnownMeans(BudgetPlanner):
    """The planner told the recording's mean accepted drafts per candidate: what its exploration alone costs."""

    def __init__(self, steps: Steps, costs: dict[int, float], explore_every: int, decay: float, reach: float):
        super().__init__(dict(costs), explore_every, decay, reach)
        paths = [p for _, prompt in steps for p in prompt]
        means = [sum(accepted(p, b) for p in paths) / len(paths) for b in self.candidates]
        self.base, self.gains = means[0], [b - a for a, b in zip(means, means[1:])]
        self.counts = [len(paths)] * len(self.candidates)

    def observe(self, budget: int, path: list[int], seconds: float | None = None) -> None:
        pass  # the means stay the recording's


def replay(steps: Steps, planner: BudgetPlanner, costs: dict[int, float]) -> tuple[float, Counter, list]:
    """(tokens per second, steps per budget, the planner's estimates after each prompt) of `auto` over the steps."""
    tokens = seconds = 0.0
    chosen: Counter = Counter()
    estimates = []
    for _, prompt in steps:
        for path in prompt:
            budget = planner.next_budget()
            chosen[budget] += 1
            tokens += 1 + accepted(path, budget)
            seconds += costs[budget]
            planner.observe(budget, path)
        estimates.append(planner.accepted)
    return tokens / seconds, chosen, estimates


def replay_stepwise(steps: Steps, expected_steps: Expected, costs: dict[int, float]) -> tuple[float, Counter]:
    """(tokens per second, steps per budget) of the stepwise planner: each step verifies the budget its own tree's
    path probabilities pick, at `costs` (a stepwise step's, per budget verified)."""
    planner, tokens, seconds, chosen = StepwisePlanner(dict(costs)), 0.0, 0.0, Counter()
    for (_, prompt), expected in zip(steps, expected_steps):
        for path, step_expected in zip(prompt, expected):
            budget = planner.choose(step_expected)
            chosen[budget] += 1
            tokens += 1 + accepted(path, budget)
            seconds += costs[budget]
    return tokens / seconds, chosen


def candidate_list(text: str) -> list[int]:
    """`1,2,4` -> [1, 2, 4]: one --candidates subset."""
    try:
        budgets = sorted({int(b) for b in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of budgets, e.g. 1,2,4,8") from None
    if not budgets or budgets[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: budgets are numbers of draft nodes (>= 1)")
    return budgets


def check_recorded(subsets: list[list[int]] | None, candidates: list[int]) -> None:
    """--candidates subsets replay only budgets the recording has."""
    missing = sorted({b for subset in subsets or [] for b in subset} - set(candidates))
    if missing:
        raise SystemExit(f"--candidates {missing} were not recorded (recorded: {candidates}): record with their union "
                         "in eval.auto_budget.candidates")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="ddtree")
    parser.add_argument("--explore-every", type=int, nargs="+", default=None, help="default: eval.auto_budget's")
    parser.add_argument("--decay", type=float, nargs="+", default=None, help="default: eval.auto_budget's")
    parser.add_argument("--explore-reach", type=float, nargs="+", default=None, help="default: eval.auto_budget's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--orders", type=int, default=1, help="prompt orders replayed (the eval's first, then shuffles)")
    parser.add_argument("--paths", type=Path, default=None, help="recorded steps and costs: replayed if it exists, else written")
    parser.add_argument("--candidates", type=candidate_list, nargs="+", default=None,
                        help="comma-separated subsets of the recorded candidates to replay `auto` among (default: all)")
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, f"eval.methods=[{args.method}]"])
    recording = {"experiment": cfg.experiment, "method": args.method}
    if args.paths and args.paths.exists():
        try:
            recorded = json.loads(args.paths.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SystemExit(f"{args.paths} is not a recording of this script ({err}): delete it to record again") from None
        if {k: recorded.get(k) for k in recording} != recording:
            raise SystemExit(f"{args.paths} records {recorded.get('method')} on {recorded.get('experiment')}, not "
                             f"{args.method} on {cfg.experiment}: another --paths file, or delete it to record again")
        costs = {int(b): c for b, c in recorded["costs"].items()}
        steps, candidates, cpu = [tuple(prompt) for prompt in recorded["steps"]], list(costs), recorded["cpu"]
        check_recorded(args.candidates, candidates)
        expected, stepwise_costs = recorded.get("expected"), recorded.get("stepwise_costs")  # older recordings lack them
    else:
        models, tokenizer = load_models(cfg)
        candidates = auto_candidates(cfg, models, args.method)
        check_recorded(args.candidates, candidates)  # before the probe and the recording, not after
        costs = step_costs(models, cfg, args.method)
        stepwise_costs = step_costs(models, cfg, args.method, stepwise=True)
        steps, expected = record_paths(models, tokenizer, cfg, args.method, {candidates[-1]: costs[candidates[-1]]})
        cpu = f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads"
        if args.paths:
            atomic_write_json(args.paths, {**recording, "costs": costs, "stepwise_costs": stepwise_costs, "steps": steps,
                                           "expected": expected, "cpu": cpu})
    n_steps = sum(len(prompt) for _, prompt in steps)
    print(f"{cfg.experiment}, {args.method}: {len(steps)} prompts, {n_steps} steps recorded at budget {candidates[-1]}; "
          f"recorded on cpu {cpu}")
    print_table_header("budget", "expected tokens/s", "vs best fixed", "steps per budget",
                       f"vs best fixed over {args.orders} prompt orders: median (min-max)")
    rates = {b: fixed_rate(steps, costs, b) for b in candidates}
    best = max(rates.values())
    for b, rate in rates.items():
        print(f"| {b} | {rate:.1f} | {rate / best:.3f} | | |")
    last = None
    auto = cfg.eval.auto_budget
    orders = [random.Random(seed).sample(steps, len(steps)) for seed in range(1, args.orders)]
    subsets = args.candidates or [candidates]
    for subset, every, decay, reach in itertools.product(subsets, args.explore_every or [auto.explore_every],
                                                         args.decay or [auto.decay], args.explore_reach or [auto.explore_reach]):
        settings = f"explore_every {every}, decay {decay}, reach {reach}" + (f", among {subset}" if args.candidates else "")
        subset_costs = {b: costs[b] for b in subset}
        planner = functools.partial(BudgetPlanner, subset_costs, every, decay, reach)  # a fresh one per replay
        rate, chosen, last = replay(steps, planner(), costs)
        mix = ", ".join(f"{b}: {n}" for b, n in sorted(chosen.items()))
        spread = sorted([rate / best] + [replay(shuffled, planner(), costs)[0] / best for shuffled in orders])
        print(f"| auto ({settings}) | {rate:.1f} | {rate / best:.3f} | {mix} | "
              f"{statistics.median(spread):.3f} ({spread[0]:.3f}-{spread[-1]:.3f}) |")
        known = replay(steps, KnownMeans(steps, subset_costs, every, decay, reach), costs)[0]
        print(f"| auto knowing the mean accepted drafts ({settings}): exploration's cost | {known:.1f} | {known / best:.3f} | | |")
    if expected and stepwise_costs:
        rate, chosen = replay_stepwise(steps, expected, {int(b): c for b, c in stepwise_costs.items()})
        mix = ", ".join(f"{b}: {n}" for b, n in sorted(chosen.items()))
        print(f"| stepwise: each step's budget from its tree's path probabilities | {rate:.1f} | {rate / best:.3f} | {mix} | |")
    oracle = prompt_oracle_rate(steps, costs)
    print(f"| each prompt at its own best fixed budget | {oracle:.1f} | {oracle / best:.3f} | | |")
    print("\naccepted drafts per step at the end of each prompt, the planner's estimate (last replay) / the prompt's mean")
    print_table_header("prompt", *map(str, candidates))
    for (name, prompt), estimate in zip(steps, last):
        cells = [f"{estimate[b]:.2f} / {sum(accepted(p, b) for p in prompt) / max(1, len(prompt)):.2f}" if b in estimate
                 else "-" for b in candidates]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
