"""Figures from result rows (results.jsonl): τ against the speculative budget, one line per method."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on the machines that run evaluations
import matplotlib.pyplot as plt  # noqa: E402


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def tau_vs_budget(rows: list[dict], out_png: Path, title: str = "") -> Path:
    """τ (committed tokens per verify step) vs draft nodes per step; chain is a single point at its block."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    methods = sorted({r["method"] for r in rows if r["budget"] is not None})
    for method in methods:
        points = sorted((r["budget"], r["tau"]) for r in rows if r["method"] == method)
        budgets, taus = zip(*points)
        ax.plot(budgets, taus, marker="o", linestyle="-" if len(points) > 1 else "none", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes per step (budget)")
    ax.set_ylabel("τ (tokens per target step)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
