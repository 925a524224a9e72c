"""Result rows: appended to results.jsonl (safe for concurrent multirun jobs), summarised as CSV and markdown.

Every eval run appends its rows; the summary is rebuilt from the whole file. A rerun of the same
measurement (same experiment, dataset, method, budget, temperature, sampling seed and sizes) replaces the older row in
the summary. A row measured without AR in the same run (e.g. a multirun job over methods) takes its
speedup from the matching AR row in the file. Per method, budget and temperature, a "macro" row averages
τ, tokens/s and speedup over the datasets (and sampling seeds, with τ's standard deviation over seeds), as
the paper reports its headline numbers.

An eval run keeps each finished measurement in `.partial/<run key>/` beside results.jsonl (`PartialRun`):
a killed run, rerun with the same command, reuses them instead of measuring again, and appends each
dataset's rows once (rows carry the run's `run_id`). A finished run removes its folder, so the same
command run again later measures afresh.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
import uuid
from itertools import zip_longest
from pathlib import Path
from statistics import fmean, stdev
from typing import TYPE_CHECKING

from filelock import FileLock

from weaver.acceptance import SAMPLING_RULES
from weaver.errors import WeaverError
from weaver.io import atomic_write_json, atomic_write_text, writable_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig

MACRO = "macro"
# What makes two rows the same measurement; the last one in the file wins.
KEY_FIELDS = ("experiment", "dataset", "method", "budget", "temperature", "sampling", "priority", "draft_temperature",
              "fixed_children", "seed", "backend", "concurrency", "n_prompts", "prompt_tokens", "max_new_tokens")
DEFAULTS = {"backend": "torch", "concurrency": 1}  # of rows written before those fields existed
# What an AR row must share with a row for its tokens/s to be that row's baseline.
BASELINE_FIELDS = ("experiment", "dataset", "temperature", "backend", "concurrency", "n_prompts", "prompt_tokens",
                   "max_new_tokens")
MACRO_FIELDS = ("tau", "tokens_per_s", "speedup_vs_ar")
SUMMARY_COLUMNS = ("experiment", "dataset", "method", "budget", "temperature", "sampling", "priority", "draft_temperature",
                   "fixed_children", "seed", "backend", "concurrency", "n_seeds", "tau",
                   "tau_std_over_seeds", "tokens_per_s", "speedup_vs_ar",
                   "greedy_match", "matches_transformers", "mean_budget", "prefill_share", "draft_share", "search_share", "verify_share",
                   "accept_share", "commit_share", "other_share", "n_prompts", "n_tokens", "prompt_tokens", "max_new_tokens")


def _lock(path: Path) -> FileLock:
    """An exclusive lock, so parallel multirun jobs do not lose each other's rows. Its file stays (hidden):
    removing a lock file on release lets a waiting job lock a file that is already gone."""
    return FileLock(path.with_name(f".{path.name}.lock"))


def result_row(cfg: DictConfig, dataset: str, method: str, budget: int | None, r: dict, ar: dict | None,
               n_prompts: int, reference: list[list[int]] | None = None, backend: str = "torch",
               concurrency: int = 1) -> dict:
    """One measurement as a row: `r` {tau, tokens_per_s, n_tokens, outputs, and optionally the time split
    (*_share), mean_budget, accept_hist}; `ar` {tokens_per_s, reference: greedy outputs} the baseline of the
    same run; `reference` transformers' greedy outputs."""
    e = cfg.eval
    return {
        "experiment": cfg.experiment, "dataset": dataset, "method": method, "budget": budget,
        "temperature": e.temperature, "sampling": e.sampling if e.temperature > 0 else None,
        "priority": tree_priority(e), "draft_temperature": draft_temperature(e), "fixed_children": fixed_children(e),
        "seed": e.seed if e.temperature > 0 else None, "backend": backend, "concurrency": concurrency,
        "tau": r["tau"], "tokens_per_s": r["tokens_per_s"],
        "speedup_vs_ar": r["tokens_per_s"] / ar["tokens_per_s"] if ar else None,
        "n_prompts": n_prompts, "n_tokens": r["n_tokens"],
        "greedy_match": r["outputs"] == ar["reference"] if ar and e.temperature == 0 else None,
        "matches_transformers": r["outputs"] == reference if reference is not None else None,
        "prompt_tokens": e.prompt_tokens, "max_new_tokens": e.max_new_tokens,
        **{k: v for k, v in r.items() if k.endswith("_share") or k in ("mean_budget", "accept_hist")},
    }


def draws_trees(e: DictConfig) -> bool:
    """Whether the run's trees were drawn from the draft distribution (sampling with a rule that draws them)."""
    return e.temperature > 0 and SAMPLING_RULES[e.sampling].draws_trees


def tree_priority(e: DictConfig) -> str | None:
    """How the run's drawn trees ranked their nodes, when not by draft probability (the default, None: rows
    written before `eval.rrs_priority` existed are those): `acceptance` (weaver/calibration.py)."""
    return e.rrs_priority if draws_trees(e) and e.rrs_priority != "draft" else None


def draft_temperature(e: DictConfig) -> float | None:
    """The temperature drawn trees were drawn at, when not the sampling temperature (None: rows written before
    `eval.draft_temperature` existed are those)."""
    return e.draft_temperature if draws_trees(e) and e.draft_temperature not in (None, e.temperature) else None


def fixed_children(e: DictConfig) -> int | None:
    """How many of each node's children drawn trees took as they are (None: none, as in rows written before
    `eval.fixed_children` existed)."""
    return e.fixed_children if draws_trees(e) and e.fixed_children else None


RUN_FIELDS = ("run_id", "dataset", "method", "budget", "backend", "concurrency")  # one row per measurement of a run


def append_rows(path: Path, rows: list[dict]) -> list[dict]:
    """Append rows to a JSONL file atomically (rewrite to a temporary file, then rename); returns all rows.
    A row whose run already wrote it (same `run_id`, dataset, method, budget) is not appended twice."""
    path = Path(path)
    writable_dir(path.parent)
    with _lock(path):
        old = read_rows(path) if path.exists() else []
        written = {_key(r, RUN_FIELDS) for r in old if r.get("run_id") is not None}
        new = [r for r in rows if r.get("run_id") is None or _key(r, RUN_FIELDS) not in written]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in old + new))
        return old + new


class PartialRun:
    """The finished measurements of one eval run, one atomic JSON file each, so that a killed run resumes.

    The folder is keyed by everything the run was asked to measure (the whole resolved config); it holds
    `run.json` (the run's id, given to its rows) and `<dataset>--<method>--<budget>.json` per measurement."""

    def __init__(self, results_dir: Path, config: dict):
        key = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
        self.folder = writable_dir(Path(results_dir) / ".partial" / key)
        meta = self.folder / "run.json"
        if not meta.exists():
            atomic_write_json(meta, {"run_id": uuid.uuid4().hex[:12]})
        self.run_id: str = json.loads(meta.read_text())["run_id"]

    def _path(self, dataset: str, method: str, budget) -> Path:
        return self.folder / f"{dataset}--{method}--{budget}.json"

    def done(self) -> int:
        return sum(1 for p in self.folder.glob("*--*.json"))

    def get(self, dataset: str, method: str, budget) -> dict | None:
        path = self._path(dataset, method, budget)
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, dataset: str, method: str, budget, result: dict) -> dict:
        atomic_write_json(self._path(dataset, method, budget), result)
        return result

    def finish(self) -> None:
        shutil.rmtree(self.folder)


def read_rows(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise WeaverError(f"{path}, line {number}, is not a JSON row ({err.msg}); fix or remove that line") from None
    return rows


def _key(row: dict, fields: tuple[str, ...]) -> tuple:
    return tuple(row.get(f, DEFAULTS.get(f)) for f in fields)


def latest_rows(rows: list[dict]) -> list[dict]:
    """One row per measurement: the last one written."""
    return list({_key(r, KEY_FIELDS): r for r in rows}.values())


def with_speedups(rows: list[dict]) -> list[dict]:
    """Rows whose speedup is missing get it from the matching AR row (same dataset, temperature, sizes)."""
    baseline = {_key(r, BASELINE_FIELDS): r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    out = []
    for r in rows:
        ar = baseline.get(_key(r, BASELINE_FIELDS))
        out.append(r if r.get("speedup_vs_ar") is not None or ar is None else {**r, "speedup_vs_ar": r["tokens_per_s"] / ar})
    return out


def macro_rows(rows: list[dict]) -> list[dict]:
    """Per (experiment, method, budget, temperature, sampling rule) measured on two or more datasets: means
    over datasets and seeds, and the spread of the per-seed macro τ (standard deviation over seeds)."""
    group_fields = ("experiment", "method", "budget", "temperature", "sampling", "priority", "draft_temperature",
                    "fixed_children", "backend", "concurrency")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["dataset"] != MACRO:
            groups.setdefault(_key(r, group_fields), []).append(r)
    out = []
    for key, members in groups.items():
        if len({m["dataset"] for m in members}) < 2:
            continue
        means = {f: fmean(m[f] for m in members) if all(m.get(f) is not None for m in members) else None for f in MACRO_FIELDS}
        seed_taus = [fmean(m["tau"] for m in members if m.get("seed") == seed) for seed in {m.get("seed") for m in members}]
        out.append({
            **dict(zip(group_fields, key)), "dataset": MACRO, **means,
            "n_seeds": len(seed_taus), "tau_std_over_seeds": stdev(seed_taus) if len(seed_taus) > 1 else None,
            **{f: _all([m.get(f) for m in members]) for f in ("greedy_match", "matches_transformers")},
            "n_prompts": sum(m["n_prompts"] for m in members), "n_tokens": sum(m["n_tokens"] for m in members),
        })
    return out


def mean_over_seeds(rows: list[dict]) -> list[dict]:
    """Rows of one measurement at several sampling seeds merged into one: τ, tokens/s and speedup averaged,
    acceptance histograms added up (what a figure plots)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r, tuple(f for f in KEY_FIELDS if f != "seed")), []).append(r)
    out = []
    for members in groups.values():
        if len(members) == 1:
            out.append(members[0])
            continue
        merged = {**members[0], "seed": None, "n_seeds": len(members)}
        merged.update({f: fmean(m[f] for m in members) if all(m.get(f) is not None for m in members) else None
                       for f in MACRO_FIELDS})
        if all(m.get("accept_hist") for m in members):
            merged["accept_hist"] = [sum(h) for h in zip_longest(*(m["accept_hist"] for m in members), fillvalue=0)]
        out.append(merged)
    return out


def _all(flags: list[bool | None]) -> bool | None:
    return None if None in flags else all(flags)


def _order(row: dict) -> tuple:
    budget = row["budget"]
    return (row["experiment"], row["temperature"], *_key(row, ("backend", "concurrency")), row["dataset"] == MACRO,
            row["dataset"], row["method"],
            budget if isinstance(budget, int) else -1 if budget is None else float("inf"))


def summarize(rows: list[dict]) -> list[dict]:
    """Latest rows with speedups filled in, plus macro rows, in table order."""
    rows = with_speedups(latest_rows(rows))
    return sorted(rows + macro_rows(rows), key=_order)


def _fmt(value, spec: str = "", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| dataset | method | budget | T | seed | τ | tokens/s | speedup vs AR | draft / search / verify share | greedy match | = transformers |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shares = " / ".join(f"{r[k]:.0%}" for k in ("draft_share", "search_share", "verify_share")) if r.get("search_share") is not None else "-"
        lines.append(f"| {r['dataset']} | {method_label(r)} | {_fmt(r['budget'])} | {r['temperature']:g} | {_seeds(r)} | {_tau(r)} | "
                     f"{_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['speedup_vs_ar'], '.2f', 'x')} | {shares} | "
                     f"{_fmt(r.get('greedy_match'))} | {_fmt(r.get('matches_transformers'))} |")
    return "\n".join(lines)


def method_label(row: dict) -> str:
    """The method, with its sampled trees' priority when not the draft's and their draft temperature when not the
    sampling one, and the serving backend and concurrency when it is not weaver's own engine at batch 1."""
    backend, concurrency, priority, draft_t, fixed = _key(row, ("backend", "concurrency", "priority", "draft_temperature",
                                                                "fixed_children"))
    label = row["method"] if priority is None else f"{row['method']}, {priority} priority"
    label = label if draft_t is None else f"{label}, draft T={draft_t:g}"
    label = label if fixed is None else f"{label}, {fixed} fixed"
    return label if backend == "torch" else f"{label} ({backend}, {concurrency} in flight)"


def _seeds(row: dict) -> str:
    return f"{row['n_seeds']} seeds" if row.get("n_seeds", 1) > 1 else _fmt(row.get("seed"))


def _tau(row: dict) -> str:
    spread = row.get("tau_std_over_seeds")
    return f"{row['tau']:.2f}" + (f" ± {spread:.2f}" if spread is not None else "")


def csv_table(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, SUMMARY_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_summary(out_dir: Path, all_rows: list[dict]) -> list[dict]:
    """summary.csv and summary.md in `out_dir`, rebuilt from every row of its results.jsonl."""
    summary = summarize(all_rows)
    atomic_write_text(Path(out_dir) / "summary.csv", csv_table(summary))
    atomic_write_text(Path(out_dir) / "summary.md", markdown_table(summary) + "\n")
    return summary
