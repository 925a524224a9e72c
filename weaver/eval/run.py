"""`eval.py`: decode prompt sets with each method at each budget; one result row per (dataset, method, budget).

Row fields (results.jsonl): experiment, dataset, method, budget, temperature, backend ("torch": weaver's own
engine; "sglang": `eval.backend=sglang`, weaver/eval/sglang_backend.py), concurrency, tau, tokens_per_s,
speedup_vs_ar, n_prompts, n_tokens, greedy_match (= our eager greedy AR decode's tokens), matches_transformers (= transformers'
own greedy `generate` on the same weights; with eval.check_transformers), prompt_tokens, max_new_tokens, and for speculative
methods the time split (prefill_share, draft_share, search_share, verify_share, accept_share, commit_share,
other_share: shares of decoding time, `weaver.engine.PHASES`; other = the caches' allocation and the loop's own
bookkeeping), mean_budget
and accept_hist (verify steps by number of accepted draft tokens). tau = committed tokens / target forward
passes (1 for autoregressive decoding). A budget may be `auto` (`weaver.budget`): each step's budget is chosen
from eval.auto_budget.candidates by measured cost and running acceptance.

One process loads the models once and runs every dataset x method x budget of its config (so budgets
share the model load and compilation), a dataset's runs interleaved prompt by prompt (`interleaved_round`); a
Hydra multirun (`python eval.py -m eval.temperature=0,1`) runs one process per combination, all appending to the
same results.jsonl. After each run, summary.csv,
summary.md and the figures are rebuilt from every row in the file (`weaver.eval.results`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from weaver.artifacts import load_adapter_for, load_drafter_for, load_target_and_tokenizer
from weaver.builders import TREE_METHODS
from weaver.budget import BudgetPlanner, StepCosts, StepwisePlanner, check_budgets, check_candidates, measure_step_costs
from weaver.calibration import RRS_PRIORITIES
from weaver.data.prompts import encode_prompts, load_prompt_set, template_kwargs
from weaver.engine import PHASES, SpecStats, speculative_generate
from weaver.errors import WeaverError
from weaver.eval.plots import write_figures
from weaver.eval.results import PartialRun, append_rows, markdown_table, read_rows, result_row, summarize, write_summary
from weaver.eval.sglang_backend import measure_in_sglang
from weaver.eval.transformers_reference import load_transformers_target, transformers_greedy
from weaver.eval.tracking import log_eval_run, wandb_enabled
from weaver.generate import generate
from weaver.io import writable_dir
from weaver.models.compile import inductor_mode
from weaver.models.config import check_context, is_count, is_finite_number
from weaver.models.linear import use_prepacked_weights

Models = dict[str, Any]  # "target", whatever the selected methods need ("drafter", ...), "step_costs" (budget: auto)
SHARES = (*(f"{phase}_share" for phase in PHASES), "other_share")  # the time split of a speculative row


@dataclass(frozen=True)
class Method:
    needs: tuple[str, ...]  # models besides the target (keys of MODEL_LOADERS); the drafter comes first
    budgets: Callable[[DictConfig, Models], list[int | str | None]]  # the budgets one run measures


def _eval_budgets(cfg: DictConfig, models: Models) -> list[int | str | None]:
    return list(cfg.eval.budgets)


def _whole_block_budgets(cfg: DictConfig, models: Models) -> list[int | str]:
    """The whole block (DFlash's chain), and `auto` (the tree's size chosen per step) when the budgets ask for it."""
    return [models["drafter"].cfg.block_size - 1] + (["auto"] if "auto" in cfg.eval.budgets else [])


AR = Method((), lambda cfg, models: [None])


def method_names() -> list[str]:
    """AR and every tree method registered in `weaver.builders.TREE_METHODS` (read when called)."""
    return ["ar", *TREE_METHODS]


def method_spec(name: str) -> Method:
    """What eval.py needs to know about a method: AR, or a tree method of the registry."""
    if name == "ar":
        return AR
    kind = TREE_METHODS[name]
    return Method(("drafter", *kind.needs), _whole_block_budgets if kind.whole_block else _eval_budgets)

# How each extra model is loaded, in order (a later loader may use the models loaded before it). Models
# a method needs beyond the drafter reach `speculative_generate` as keyword arguments of the same name.
MODEL_LOADERS: dict[str, Callable[[DictConfig, Models], Any]] = {
    "drafter": lambda cfg, models: load_drafter_for(cfg, models["target"]),
    "adapter": lambda cfg, models: load_adapter_for(cfg, models["target"], models["drafter"]),
}


def load_models(cfg: DictConfig) -> tuple[Models, Any]:
    """The target, the extra models the selected methods need, and the tokenizer."""
    use_prepacked_weights(cfg.eval.prepack)
    target, tokenizer = load_target_and_tokenizer(cfg)
    models: Models = {"target": target}
    needed = {name for method in cfg.eval.methods for name in method_spec(method).needs}
    for name, load in MODEL_LOADERS.items():
        if name in needed:
            models[name] = load(cfg, models)
    return models, tokenizer


def interleaved_round(decoders: dict[Any, Callable], prompts: list[list[int]], shift: int = 0,
                      desc: str = "prompts") -> dict[Any, tuple[list[list[int]], list, float]]:
    """Every prompt through every `decode(prompt) -> (tokens, stats)`, prompt by prompt, the decoders' order rotated
    from one prompt to the next (and by `shift`), so that a drift in the machine's speed hits every run alike:
    {key: (outputs, stats, seconds spent decoding)}."""
    keys = list(decoders)
    if not keys:
        return {}
    outputs, stats, seconds = ({k: [] for k in keys}, {k: [] for k in keys}, dict.fromkeys(keys, 0.0))
    for i, prompt in enumerate(tqdm(prompts, desc=desc, leave=False)):
        first = (shift + i) % len(keys)
        for key in keys[first:] + keys[:first]:
            start = time.perf_counter()
            tokens, info = decoders[key](prompt)
            seconds[key] += time.perf_counter() - start
            outputs[key].append(tokens)
            stats[key].append(info)
    return {k: (outputs[k], stats[k], seconds[k]) for k in keys}


def ar_decoder(models: Models, cfg: DictConfig, eos: int | None) -> Callable[[list[int]], tuple[list[int], None]]:
    """The timed baseline's decode(prompt) -> (tokens, None): compiled unless eval.compile=false."""
    generator = torch.Generator().manual_seed(cfg.eval.seed)
    e = cfg.eval
    return lambda prompt: (generate(models["target"], [prompt], e.max_new_tokens, e.temperature, eos, generator,
                                    e.compile)[0], None)


def greedy_reference(models: Models, prompts: list[list[int]], cfg: DictConfig, eos: int | None) -> list[list[int]]:
    """The greedy tokens every method's are compared with: eager decoding, the same kernels the engine runs.
    (Inductor's fused kernels round differently and can flip near-ties: seen on AVX2-only CPUs.)"""
    return [generate(models["target"], [p], cfg.eval.max_new_tokens, 0.0, eos)[0] for p in prompts]


def ar_summary(outputs: list[list[int]], seconds: float) -> dict:
    """The AR row's τ (1), tokens/s and outputs."""
    n_tokens = sum(map(len, outputs))
    return {"tau": 1.0, "tokens_per_s": n_tokens / seconds, "n_tokens": n_tokens, "outputs": outputs}


def ar_result(models: Models, prompts: list[list[int]], cfg: DictConfig, eos: int | None, outputs: list[list[int]],
              seconds: float) -> dict:
    """The AR row and, at temperature 0, the greedy reference (`greedy_reference` where the baseline is compiled;
    the AR row's own greedy_match says whether the compiled baseline agreed)."""
    reference = outputs
    if cfg.eval.compile and cfg.eval.temperature == 0:
        reference = greedy_reference(models, prompts, cfg, eos)
    return {**ar_summary(outputs, seconds), "reference": reference}


def speculative_run(models: Models, cfg: DictConfig, eos: int | None, method: str,
                    budget: int | str) -> Callable[[list[int]], tuple[list[int], SpecStats]]:
    """decode(prompt) -> (tokens, SpecStats) for one run of `method` at `budget`: one generator and, for `auto`,
    one planner, both carried from prompt to prompt."""
    generator = torch.Generator().manual_seed(cfg.eval.seed)
    plan = auto_planner(models, cfg, method) if budget == "auto" else budget
    decode = speculative_decoder(models, cfg, method, eos, generator)
    return lambda prompt: decode(prompt, plan)


def speculative_summary(outputs: list[list[int]], stats: list[SpecStats], seconds: float, block_size: int) -> dict:
    """A run's row: τ, tokens/s, the time split and the budgets its steps took."""
    total = SpecStats.merge(stats)
    n_tokens = sum(map(len, outputs))
    shares = {f"{phase}_share": total.seconds[phase] / seconds for phase in PHASES}
    return {
        "tau": total.tau, "tokens_per_s": n_tokens / seconds, "n_tokens": n_tokens, "outputs": outputs,
        **shares, "other_share": 1 - sum(shares.values()),
        "mean_budget": sum(total.budgets) / max(1, len(total.budgets)),
        "budget_steps": dict(sorted(Counter(total.budgets).items())),  # steps taken at each budget
        "accept_hist": torch.bincount(torch.tensor(total.accepted, dtype=torch.long), minlength=block_size).tolist(),
    }


def speculative_decoder(models: Models, cfg: DictConfig, method: str, eos: int | None, generator: torch.Generator | None,
                        max_new_tokens: int | None = None, on_step: Callable | None = None) -> Callable[..., tuple]:
    """decode(prompt, budget) -> (tokens, SpecStats) with the method's models and the eval settings (`on_step`:
    `speculative_generate`'s)."""
    e = cfg.eval
    extra = {name: models[name] for name in method_spec(method).needs if name != "drafter"}
    search = cfg.weaver.search
    priority = RRS_PRIORITIES[e.rrs_priority]()  # one table learns across the run's prompts
    options = dict(sampling=e.sampling, children=search.children, nodes_per_call=search.nodes_per_call,
                   rescore=search.rescore, compiled=e.compile, priority=priority,
                   draft_temperature=e.draft_temperature, fixed_children=e.fixed_children, on_step=on_step, **extra)
    max_new_tokens = max_new_tokens or e.max_new_tokens
    return lambda prompt, budget: speculative_generate(models["target"], models["drafter"], prompt, max_new_tokens,
                                                       e.temperature, eos, generator, method, budget, **options)


def auto_candidates(cfg: DictConfig, models: Models, method: str) -> list[int]:
    """The budgets `auto` chooses among for `method` (a chain's stop at its block)."""
    whole_block = TREE_METHODS[method].whole_block
    return [b for b in cfg.eval.auto_budget.candidates if not whole_block or b < models["drafter"].cfg.block_size]


def auto_planner(models: Models, cfg: DictConfig, method: str) -> StepCosts:
    """`budget: auto`'s planner for `method`: from running means of what steps accepted, or with
    eval.auto_budget.stepwise, greedy chains and DDTrees from each step's own tree."""
    auto = cfg.eval.auto_budget
    stepwise = bool(auto.stepwise and cfg.eval.temperature == 0 and TREE_METHODS[method].stepwise)
    costs = step_costs(models, cfg, method, stepwise)
    return StepwisePlanner(costs, auto.decay) if stepwise else BudgetPlanner(costs, auto.explore_every, auto.decay,
                                                                             auto.explore_reach)


def step_costs(models: Models, cfg: DictConfig, method: str, stepwise: bool = False) -> dict[int, float]:
    """Seconds per speculative step at each candidate budget of eval.auto_budget for `method`, measured once
    per process on a fixed pseudo-random prompt of eval.prompt_tokens tokens (a chain's candidates stop at
    the block); `stepwise`: as `StepwisePlanner` steps take them, the tree built at the largest candidate."""
    costs = models.setdefault("step_costs", {})
    key = (method, stepwise, *sorted(OmegaConf.to_container(cfg.weaver.search).items()))  # a run may set its own search
    if key not in costs:
        auto = cfg.eval.auto_budget
        candidates = auto_candidates(cfg, models, method)
        vocab = models["target"].cfg.vocab_size
        prompt = torch.randint(vocab, (cfg.eval.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        decode = speculative_decoder(models, cfg, method, None, torch.Generator().manual_seed(0), max_new_tokens=auto.probe_tokens)

        def step_seconds(budget: int) -> list[float]:
            stats = decode(prompt, StepwisePlanner({budget: 1.0}, build=candidates[-1]) if stepwise else budget)[1]
            return [sum(stats.seconds.values()) / len(stats.accepted)]

        costs[key] = measure_step_costs(step_seconds, candidates, auto.repeats)
        print(f"budget auto, {method}{' (stepwise)' if stepwise else ''}: ms per step " + ", ".join(f"{b}: {1e3 * c:.1f}" for b, c in costs[key].items()))
    return costs[key]


def warm_up(models: Models, cfg: DictConfig, token: int, runs: list[tuple[str, int | str]] | None = None) -> None:
    """A short decode of each kind outside the timed loops: first calls pay for allocation and compilation;
    with eval.compile, the verify and draft graphs of every tree size the (method, budget) runs will verify
    (default: the config's)."""
    if "ar" in cfg.eval.methods:
        generate(models["target"], [[token] * 4], 4, compiled=cfg.eval.compile)
    if cfg.eval.compile and "drafter" in models:
        if runs is None:
            runs = [(m, b) for m in cfg.eval.methods if m != "ar" for b in method_spec(m).budgets(cfg, models)]
        budgets = {(method, b) for method, budget in runs
                   for b in (auto_candidates(cfg, models, method) if budget == "auto" else [budget])}
        sizes = {b + 1 for _, b in budgets}
        models["target"].compile_verify(sizes, models["drafter"].cfg.target_layer_ids, cfg.eval.compile)
        models["drafter"].compile_draft(models["target"], {size - 1 for size in sizes}, cfg.eval.compile)
        if "adapter" in models and cfg.weaver.search.rescore:  # the rescored search: a static graph per budget
            for b in sorted({b for method, b in budgets if method == "weaver"}):
                speculative_generate(models["target"], models["drafter"], [token] * 4, 2, method="weaver", budget=b,
                                     adapter=models["adapter"], compiled=cfg.eval.compile,
                                     children=cfg.weaver.search.children, rescore=cfg.weaver.search.rescore)
    if "drafter" in models:
        speculative_generate(models["target"], models["drafter"], [token] * 4, 4)
    if "adapter" in models:
        speculative_generate(models["target"], models["drafter"], [token] * 4, 4, method="weaver", budget=4,
                             adapter=models["adapter"], compiled=cfg.eval.compile, rescore=cfg.weaver.search.rescore)


def check_names(cfg: DictConfig) -> None:
    """Refuse unknown methods and datasets, malformed budgets and seeds, before anything slow happens."""
    if cfg.eval.backend not in BACKENDS:
        raise WeaverError(f"eval.backend must be one of {list(BACKENDS)}, got {cfg.eval.backend!r}")
    unknown = [m for m in cfg.eval.methods if m not in method_names()] + [d for d in cfg.eval.datasets if d not in cfg.prompt_sets]
    if unknown:
        raise WeaverError(f"unknown method/dataset {unknown}; methods: {method_names()}, datasets: {list(cfg.prompt_sets)}")
    check_budgets(list(cfg.eval.budgets))
    if not is_count(cfg.eval.seed, 0):
        raise WeaverError(f"eval.seed must be a whole number >= 0, got {cfg.eval.seed!r}")
    if cfg.eval.rrs_priority not in RRS_PRIORITIES:
        raise WeaverError(f"eval.rrs_priority must be one of {list(RRS_PRIORITIES)}, got {cfg.eval.rrs_priority!r}")
    draft_t = cfg.eval.draft_temperature
    if draft_t is not None and (not is_finite_number(draft_t) or draft_t <= 0):
        raise WeaverError(f"eval.draft_temperature must be a finite number > 0 or null, got {draft_t!r}")
    if not is_count(cfg.eval.fixed_children, 0):
        raise WeaverError(f"eval.fixed_children must be a whole number >= 0, got {cfg.eval.fixed_children!r}")
    if cfg.eval.fixed_children and cfg.eval.temperature > 0 and cfg.eval.sampling != "rrs":
        raise WeaverError(f"eval.fixed_children needs eval.sampling=rrs, got {cfg.eval.sampling!r}")
    if not isinstance(cfg.eval.prepack, bool):
        raise WeaverError(f"eval.prepack must be true or false, got {cfg.eval.prepack!r}")
    if "auto" in cfg.eval.budgets:
        check_candidates(list(cfg.eval.auto_budget.candidates))
    if cfg.eval.compile:
        inductor_mode(cfg.eval.compile)


def evaluate_dataset(cfg: DictConfig, dataset: str, prompts: list[list[int]], models: Models, eos: int | None,
                     partial: PartialRun, bar: tqdm) -> list[dict]:
    """Every (method, budget) of the config on one prompt set, interleaved prompt by prompt (`interleaved_round`),
    so that each row's speedup over AR compares decodes of the same minutes. The measurements are kept in
    `partial` when the set is done, and taken from there when a killed run reruns."""
    runs = [(m, b) for m in sorted(cfg.eval.methods, key=lambda m: m != "ar") for b in method_spec(m).budgets(cfg, models)]
    results = {run: saved for run in runs if (saved := partial.get(dataset, *run)) is not None}
    decoders = {(m, b): ar_decoder(models, cfg, eos) if m == "ar" else speculative_run(models, cfg, eos, m, b)
                for m, b in runs if (m, b) not in results}
    bar.set_postfix_str(f"{dataset}: {len(decoders)} runs interleaved")
    for (method, budget), (outputs, stats, seconds) in interleaved_round(decoders, prompts, desc=dataset).items():
        result = (ar_result(models, prompts, cfg, eos, outputs, seconds) if method == "ar"
                  else speculative_summary(outputs, stats, seconds, models["drafter"].cfg.block_size))
        results[method, budget] = partial.put(dataset, method, budget, result)
    bar.update(len(runs))
    results = {run: results[run] for run in runs}  # AR first, the config's order
    ar = results.get(("ar", None))
    reference = None
    if "transformers" in models and cfg.eval.temperature == 0:
        reference = (partial.get(dataset, "transformers", None) or partial.put(
            dataset, "transformers", None, {"outputs": transformers_greedy(models["transformers"], prompts, cfg.eval.max_new_tokens, eos)}
        ))["outputs"]
    return [{**result_row(cfg, dataset, method, budget, r, ar, len(prompts), reference), "run_id": partial.run_id}
            for (method, budget), r in results.items()]


def measure_in_weaver(cfg: DictConfig, prompt_sets: dict, results: Path, partial: PartialRun) -> list[dict]:
    """Every dataset x method x budget through weaver's own engine; each dataset's rows appended to `results`
    as soon as they are done (a crash keeps them)."""
    models, tokenizer = load_models(cfg)
    e = cfg.eval
    check_context(models["target"].cfg, e.prompt_tokens, e.max_new_tokens, "eval.prompt_tokens")
    warm_up(models, cfg, tokenizer.eos_token_id or 0)
    if e.check_transformers and e.temperature == 0:
        weight = models["target"].embed.weight
        models["transformers"] = load_transformers_target(cfg, weight.dtype, weight.device)
    n_runs = len(e.datasets) * sum(len(method_spec(m).budgets(cfg, models)) for m in e.methods)
    rows = []
    with tqdm(total=n_runs, desc="eval") as bar:
        for name, rows_of_set in prompt_sets.items():
            prompts = encode_prompts(rows_of_set, tokenizer, e.n_prompts, e.prompt_tokens, e.long_prompts,
                                     template_kwargs(cfg))
            dataset_rows = evaluate_dataset(cfg, name, prompts, models, tokenizer.eos_token_id, partial, bar)
            append_rows(results, dataset_rows)
            rows += dataset_rows
    return rows


BACKENDS = {"torch": measure_in_weaver, "sglang": measure_in_sglang}  # eval.backend -> how rows are measured


def evaluate(cfg: DictConfig) -> list[dict]:
    """Measure cfg.eval's datasets x methods x budgets; append the rows, rebuild summaries and figures, log to W&B."""
    check_names(cfg)
    out_dir = writable_dir(Path(cfg.eval.out_dir or Path(cfg.paths.root) / cfg.experiment / "eval"))
    prompt_sets = {name: load_prompt_set(cfg, name) for name in cfg.eval.datasets}  # hub errors before the model load
    partial = PartialRun(out_dir, OmegaConf.to_container(cfg, resolve=True))
    if done := partial.done():
        print(f"eval: resuming a killed run, {done} measurements already done ({partial.folder})")
    rows = BACKENDS[cfg.eval.backend](cfg, prompt_sets, out_dir / "results.jsonl", partial)
    summary = write_summary(out_dir, read_rows(out_dir / "results.jsonl"))
    figures = write_figures([r for r in summary if r["experiment"] == cfg.experiment], out_dir, cfg.experiment)
    run_summary = summarize(rows)
    print(markdown_table(run_summary))
    print(f"results: {out_dir / 'results.jsonl'} (all runs: {out_dir / 'summary.md'}, {out_dir / 'summary.csv'})")
    for path in figures:
        print(f"figure: {path}")
    if wandb_enabled(cfg):
        run_dir = log_eval_run(cfg, run_summary, figures)
        print(f"W&B run: {run_dir}" + (f" (upload: wandb sync {run_dir})" if cfg.wandb.mode == "offline" else ""))
    partial.finish()  # done: the same command run again measures afresh
    return rows
