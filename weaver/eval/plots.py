"""The paper's figures from result rows (`weaver.eval.results.summarize` of a results.jsonl).

τ vs budget (one panel per dataset, macro last), speedup bars per dataset, acceptance-length
histograms, and GDN tree-verify cost vs tree size. Functions return matplotlib Figures (no pyplot, so
nothing global changes and notebooks display them inline); `save_figure` writes a PNG. A line or bar is
one method, or one (method, temperature) when the rows span several temperatures.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from weaver.eval.results import MACRO, mean_over_seeds, method_label


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped into plotted series: by method, and by temperature too when there are several; one
    measurement's rows at several sampling seeds are plotted as their mean."""
    several = len({r["temperature"] for r in rows}) > 1
    out: dict[str, list[dict]] = {}
    for r in mean_over_seeds(rows):
        label = method_label(r)
        out.setdefault(f"{label}, T={r['temperature']:g}" if several else label, []).append(r)
    return out


def _datasets(rows: list[dict]) -> list[str]:
    """Datasets in plotting order: alphabetical, the macro average last."""
    return sorted({r["dataset"] for r in rows}, key=lambda d: (d == MACRO, d))


def _panels(n: int, title: str, width: float = 4.2, height: float = 3.4) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, axes[:n]


def tau_vs_budget(rows: list[dict], title: str = "") -> Figure:
    """τ (committed tokens per verify step) vs draft nodes per step; chain is a single point at its block.
    Rows with budget `auto` have no fixed budget to plot against: the speedup figure shows them."""
    rows = [r for r in rows if isinstance(r["budget"], int)]
    datasets = _datasets(rows)
    fig, axes = _panels(len(datasets), title)
    for ax, dataset in zip(axes, datasets):
        for label, members in _series([r for r in rows if r["dataset"] == dataset]).items():
            budgets, taus = zip(*sorted((r["budget"], r["tau"]) for r in members))
            ax.plot(budgets, taus, marker="o", linestyle="-" if len(budgets) > 1 else "none", label=label)
        ax.set_xscale("log", base=2)
        ax.set(title=dataset, xlabel="draft nodes per step (budget)", ylabel="τ (tokens per target step)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return fig


def _best_budgets(rows: list[dict]) -> dict[str, object]:
    """Per series, the budget with the highest mean speedup over the datasets (what a user would deploy)."""
    best = {}
    for label, members in _series(rows).items():
        by_budget: dict[object, list[float]] = {}
        for r in members:
            by_budget.setdefault(r["budget"], []).append(r["speedup_vs_ar"])
        best[label] = max(by_budget, key=lambda b: sum(by_budget[b]) / len(by_budget[b]))
    return best


def speedup_bars(rows: list[dict], title: str = "") -> Figure:
    """Speedup vs AR per dataset (macro last), each method at its best budget; AR is the line at 1."""
    rows = [r for r in rows if r["method"] != "ar" and r.get("speedup_vs_ar") is not None]
    datasets, best = _datasets(rows), _best_budgets(rows)
    fig = Figure(figsize=(max(5.5, 1.3 * len(datasets) * max(1, len(best)) / 2), 3.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(best))
    for i, (label, members) in enumerate(_series(rows).items()):
        chosen = {r["dataset"]: r["speedup_vs_ar"] for r in members if r["budget"] == best[label]}
        xs = [j + (i - (len(best) - 1) / 2) * width for j in range(len(datasets))]
        ax.bar(xs, [chosen.get(d, 0.0) for d in datasets], width, label=f"{label} (budget {best[label]})")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="AR")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set(ylabel="speedup vs AR (tokens/s)", title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    return fig


def acceptance_histograms(rows: list[dict], title: str = "") -> Figure:
    """Share of verify steps by accepted draft tokens, pooled over datasets; each method at its largest budget."""
    rows = [r for r in rows if r.get("accept_hist") and r["dataset"] != MACRO and isinstance(r["budget"], int)]
    series = _series(rows)
    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(series))
    for i, (label, members) in enumerate(series.items()):
        budget = max(r["budget"] for r in members)
        hists = [r["accept_hist"] for r in members if r["budget"] == budget]
        pooled = [sum(h[k] for h in hists if k < len(h)) for k in range(max(map(len, hists)))]
        total = sum(pooled)
        ax.bar([k + (i - (len(series) - 1) / 2) * width for k in range(len(pooled))], [c / total for c in pooled],
               width, label=f"{label} (budget {budget})")
    ax.set(xlabel="accepted draft tokens per step", ylabel="share of steps", title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    return fig


def gdn_verify_cost(points: list[dict], title: str = "GDN tree verify, one layer") -> Figure:
    """Milliseconds per verify vs tree size T: per-branch recurrence vs the parallel form, ratio annotated.

    points: [{"T": 16, "per_branch_ms": 66.0, "parallel_ms": 2.3}, ...] (benchmarks/gdn_tree_verify.py).
    """
    points = sorted(points, key=lambda p: p["T"])
    sizes = [p["T"] for p in points]
    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(sizes, [p["per_branch_ms"] for p in points], marker="o", label="per-branch recurrence")
    ax.plot(sizes, [p["parallel_ms"] for p in points], marker="o", label="parallel (rollback-free)")
    for p in points:
        ax.annotate(f"{p['per_branch_ms'] / p['parallel_ms']:.1f}x", (p["T"], p["parallel_ms"]),
                    textcoords="offset points", xytext=(0, -14), ha="center", fontsize="small")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="tree nodes T", ylabel="ms per layer", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def result_figures(rows: list[dict], title: str = "") -> dict[str, Figure]:
    """The figures the rows have data for, by file stem: tau_vs_budget, speedup, acceptance."""
    figures = {}
    if any(r["budget"] is not None for r in rows):
        figures["tau_vs_budget"] = tau_vs_budget(rows, f"{title}: τ vs budget")
    if any(r["method"] != "ar" and r.get("speedup_vs_ar") is not None for r in rows):
        figures["speedup"] = speedup_bars(rows, f"{title}: speedup vs AR")
    if any(r.get("accept_hist") for r in rows):
        figures["acceptance"] = acceptance_histograms(rows, f"{title}: accepted draft tokens per step")
    return figures


def save_figure(fig: Figure, out_png: Path) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    return out_png


def write_figures(rows: list[dict], out_dir: Path, title: str = "") -> list[Path]:
    """Every figure `result_figures` makes, as `<stem>.png` in out_dir."""
    return [save_figure(fig, Path(out_dir) / f"{stem}.png") for stem, fig in result_figures(rows, title).items()]
