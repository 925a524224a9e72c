"""Result rows: appended to results.jsonl (safe for concurrent multirun jobs), summarised as CSV and markdown.

Every eval run appends its rows; the summary is rebuilt from the whole file. A rerun of the same
measurement (same experiment, dataset, method, budget, temperature and sizes) replaces the older row in
the summary. A row measured without AR in the same run (e.g. a multirun job over methods) takes its
speedup from the matching AR row in the file. Per method, budget and temperature, a "macro" row averages
τ, tokens/s and speedup over the datasets, as the paper reports its headline numbers.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from statistics import fmean

from filelock import FileLock

from weaver.io import atomic_write_text, writable_dir

MACRO = "macro"
# What makes two rows the same measurement; the last one in the file wins.
KEY_FIELDS = ("experiment", "dataset", "method", "budget", "temperature", "sampling", "n_prompts", "prompt_tokens",
              "max_new_tokens")
# What an AR row must share with a row for its tokens/s to be that row's baseline.
BASELINE_FIELDS = ("experiment", "dataset", "temperature", "n_prompts", "prompt_tokens", "max_new_tokens")
MACRO_FIELDS = ("tau", "tokens_per_s", "speedup_vs_ar")
SUMMARY_COLUMNS = ("experiment", "dataset", "method", "budget", "temperature", "sampling", "tau", "tokens_per_s", "speedup_vs_ar",
                   "greedy_match", "matches_transformers", "mean_budget", "draft_share", "search_share", "verify_share",
                   "accept_share", "commit_share", "other_share", "n_prompts", "n_tokens", "prompt_tokens", "max_new_tokens")


def _lock(path: Path) -> FileLock:
    """An exclusive lock, so parallel multirun jobs do not lose each other's rows. Its file stays (hidden):
    removing a lock file on release lets a waiting job lock a file that is already gone."""
    return FileLock(path.with_name(f".{path.name}.lock"))


def append_rows(path: Path, rows: list[dict]) -> list[dict]:
    """Append rows to a JSONL file atomically (rewrite to a temporary file, then rename); returns all rows."""
    path = Path(path)
    writable_dir(path.parent)
    with _lock(path):
        old = path.read_text() if path.exists() else ""
        atomic_write_text(path, old + "".join(json.dumps(r) + "\n" for r in rows))
        return read_rows(path)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _key(row: dict, fields: tuple[str, ...]) -> tuple:
    return tuple(row.get(f) for f in fields)


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
    over datasets."""
    group_fields = ("experiment", "method", "budget", "temperature", "sampling")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["dataset"] != MACRO:
            groups.setdefault(_key(r, group_fields), []).append(r)
    out = []
    for key, members in groups.items():
        if len({m["dataset"] for m in members}) < 2:
            continue
        means = {f: fmean(m[f] for m in members) if all(m.get(f) is not None for m in members) else None for f in MACRO_FIELDS}
        out.append({
            **dict(zip(group_fields, key)), "dataset": MACRO, **means,
            **{f: _all([m.get(f) for m in members]) for f in ("greedy_match", "matches_transformers")},
            "n_prompts": sum(m["n_prompts"] for m in members), "n_tokens": sum(m["n_tokens"] for m in members),
        })
    return out


def _all(flags: list[bool | None]) -> bool | None:
    return None if None in flags else all(flags)


def _order(row: dict) -> tuple:
    budget = row["budget"]
    return (row["experiment"], row["temperature"], row["dataset"] == MACRO, row["dataset"], row["method"],
            budget if isinstance(budget, int) else -1 if budget is None else float("inf"))


def summarize(rows: list[dict]) -> list[dict]:
    """Latest rows with speedups filled in, plus macro rows, in table order."""
    rows = with_speedups(latest_rows(rows))
    return sorted(rows + macro_rows(rows), key=_order)


def _fmt(value, spec: str = "", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| dataset | method | budget | T | τ | tokens/s | speedup vs AR | draft / search / verify share | greedy match | = transformers |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shares = " / ".join(f"{r[k]:.0%}" for k in ("draft_share", "search_share", "verify_share")) if r.get("search_share") is not None else "-"
        lines.append(f"| {r['dataset']} | {r['method']} | {_fmt(r['budget'])} | {r['temperature']:g} | {r['tau']:.2f} | "
                     f"{_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['speedup_vs_ar'], '.2f', 'x')} | {shares} | "
                     f"{_fmt(r.get('greedy_match'))} | {_fmt(r.get('matches_transformers'))} |")
    return "\n".join(lines)


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
