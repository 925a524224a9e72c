"""`eval.py`: decode prompt sets with each method and write one result row per (dataset, method).

Row schema (results.jsonl): experiment, dataset, method, budget, temperature, tau, tokens_per_s,
speedup_vs_ar, n_prompts, n_tokens, greedy_match. tau = committed tokens / target forward passes
(1 for autoregressive decoding).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from weaver.engine import TREE_METHODS, SpecStats, speculative_generate
from weaver.errors import WeaverError
from weaver.eval.plots import tau_vs_budget
from weaver.generate import generate
from weaver.io import atomic_write_text
from weaver.pipeline import artifact_dir, load_drafter_for, load_target_and_tokenizer


def heldout_code_prompts(cfg: DictConfig, n: int, prompt_tokens: int) -> list[list[int]]:
    """Openings of held-out rows of the target's own corpus (files never seen in pretraining)."""
    if cfg.model.source != "scratch":
        raise WeaverError("dataset 'heldout_code' needs a target trained here (model.source=scratch)")
    rows = datasets.load_from_disk(str(artifact_dir(cfg, "corpus") / "dataset"))["validation"]
    if len(rows) < n:
        raise WeaverError(f"heldout_code has {len(rows)} rows, fewer than eval.n_prompts={n}")
    return [row[:prompt_tokens] for row in rows[:n]["input_ids"]]


PROMPT_SETS = {"heldout_code": heldout_code_prompts}


def decode_all(prompts: list[list[int]], decode) -> tuple[list[list[int]], list, float]:
    """Run `decode(prompt) -> (tokens, stats)` on every prompt; (outputs, stats, seconds spent decoding)."""
    outputs, stats, seconds = [], [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        tokens, info = decode(prompt)
        seconds += time.perf_counter() - start
        outputs.append(tokens)
        stats.append(info)
    return outputs, stats, seconds


def run_ar(model, prompts: list[list[int]], cfg: DictConfig, eos: int | None) -> dict:
    generator = torch.Generator().manual_seed(cfg.seed)
    e = cfg.eval
    outputs, _, seconds = decode_all(
        prompts, lambda p: (generate(model, [p], e.max_new_tokens, e.temperature, eos, generator, e.compile)[0], None)
    )
    n_tokens = sum(map(len, outputs))
    return {"tau": 1.0, "tokens_per_s": n_tokens / seconds, "n_tokens": n_tokens, "outputs": outputs}


def run_speculative(
    model, prompts: list[list[int]], cfg: DictConfig, eos: int | None, drafter, method: str, budget: int
) -> dict:
    generator = torch.Generator().manual_seed(cfg.seed)
    e = cfg.eval
    outputs, stats, seconds = decode_all(
        prompts,
        lambda p: speculative_generate(model, drafter, p, e.max_new_tokens, e.temperature, eos, generator, method, budget),
    )
    total = SpecStats([a for s in stats for a in s.accepted], sum(s.draft_s for s in stats), sum(s.verify_s for s in stats))
    n_tokens = sum(map(len, outputs))
    return {
        "tau": total.tau, "tokens_per_s": n_tokens / seconds, "n_tokens": n_tokens, "outputs": outputs,
        "draft_share": total.draft_s / seconds,
        "verify_share": total.verify_s / seconds,
        "accept_hist": torch.bincount(torch.tensor(total.accepted, dtype=torch.long), minlength=drafter.cfg.block_size).tolist(),
    }


def runs(cfg: DictConfig, drafter) -> list[tuple[str, int | None]]:
    """(method, budget) pairs: AR once, chain at block_size - 1, tree methods at every eval budget."""
    out = []
    for method in cfg.eval.methods:
        if method == "ar":
            out.append((method, None))
        elif method == "chain":
            out.append((method, drafter.cfg.block_size - 1))
        else:
            out += [(method, b) for b in cfg.eval.budgets]
    return out


METHODS = ("ar",) + TREE_METHODS


def evaluate(cfg: DictConfig) -> list[dict]:
    unknown = [m for m in cfg.eval.methods if m not in METHODS] + [d for d in cfg.eval.datasets if d not in PROMPT_SETS]
    if unknown:
        raise WeaverError(f"unknown method/dataset {unknown}; methods: {list(METHODS)}, datasets: {list(PROMPT_SETS)}")
    out_dir = Path(cfg.eval.out_dir or Path(cfg.paths.root) / cfg.experiment / "eval")
    model, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, model) if set(cfg.eval.methods) - {"ar"} else None
    if cfg.eval.compile:  # compile (and warm up) outside the timed loops
        generate(model, [[tokenizer.eos_token_id or 0] * 4], 4, compiled=True)
    rows = []
    for dataset in cfg.eval.datasets:
        prompts = PROMPT_SETS[dataset](cfg, cfg.eval.n_prompts, cfg.eval.prompt_tokens)
        results = {}
        for method, budget in tqdm(runs(cfg, drafter), desc=f"eval {dataset}"):
            eos = tokenizer.eos_token_id
            results[method, budget] = (
                run_ar(model, prompts, cfg, eos) if method == "ar"
                else run_speculative(model, prompts, cfg, eos, drafter, method, budget)
            )
        ar = results.get(("ar", None))
        for (method, budget), r in results.items():
            rows.append({
                "experiment": cfg.experiment, "dataset": dataset, "method": method, "budget": budget,
                "temperature": cfg.eval.temperature, "tau": r["tau"], "tokens_per_s": r["tokens_per_s"],
                "speedup_vs_ar": r["tokens_per_s"] / ar["tokens_per_s"] if ar else None,
                "n_prompts": len(prompts), "n_tokens": r["n_tokens"],
                "greedy_match": r["outputs"] == ar["outputs"] if ar and cfg.eval.temperature == 0 else None,
                **{k: r[k] for k in ("draft_share", "verify_share", "accept_hist") if k in r},
            })
    append_results(out_dir / "results.jsonl", rows)
    print(summary_table(rows))
    print(f"results: {out_dir / 'results.jsonl'}")
    if any(r["budget"] is not None for r in rows):
        print(f"figure: {tau_vs_budget(rows, out_dir / 'tau_vs_budget.png', f'{cfg.experiment}: τ vs budget')}")
    return rows


def append_results(path: Path, rows: list[dict]) -> None:
    """Append rows to a JSONL file atomically (rewrite to a temporary file, then rename)."""
    old = path.read_text() if path.exists() else ""
    atomic_write_text(path, old + "".join(json.dumps(r) + "\n" for r in rows))


def summary_table(rows: list[dict]) -> str:
    lines = ["| dataset | method | budget | tau | tokens/s | speedup vs AR | greedy match |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] is not None else "-"
        lines.append(f"| {r['dataset']} | {r['method']} | {r['budget'] or '-'} | {r['tau']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {speedup} | {r['greedy_match']} |")
    return "\n".join(lines)
