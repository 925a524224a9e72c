"""Result rows, summaries, figures and W&B logging of eval runs (no models involved)."""

from __future__ import annotations

import csv
import io
import multiprocessing
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from weaver.eval import plots
from weaver.eval.results import append_rows, markdown_table, mean_over_seeds, read_rows, summarize, write_summary
from weaver.eval.tracking import log_eval_run, wandb_enabled


def row(dataset: str, method: str, budget: int | None, tokens_per_s: float, tau: float = 1.0, **extra) -> dict:
    speculative = method != "ar"
    return {
        "experiment": "toy", "dataset": dataset, "method": method, "budget": budget, "temperature": 0.0, "tau": tau,
        "tokens_per_s": tokens_per_s, "speedup_vs_ar": None, "n_prompts": 2, "n_tokens": 64, "greedy_match": True,
        "prompt_tokens": 64, "max_new_tokens": 32,
        **({"draft_share": 0.2, "search_share": 0.05, "verify_share": 0.7, "accept_hist": [3, 2, 1, 0]} if speculative else {}), **extra,
    }


ROWS = [
    row("code", "ar", None, 100.0), row("code", "chain", 3, 150.0, 2.0), row("code", "ddtree", 4, 200.0, 2.5),
    row("code", "ddtree", 8, 180.0, 3.0),
    row("chat", "ar", None, 50.0), row("chat", "chain", 3, 100.0, 1.5), row("chat", "ddtree", 4, 50.0, 1.8),
    row("chat", "ddtree", 8, 75.0, 2.2),
]


def test_summary_fills_speedups_keeps_latest_rows_and_adds_macro():
    rerun = row("code", "ddtree", 8, 300.0, 3.0)  # the same measurement again: replaces the older row
    summary = summarize(ROWS + [rerun])
    by_key = {(r["dataset"], r["method"], r["budget"]): r for r in summary}
    assert len(summary) == len(ROWS) + 4  # 4 macro rows: ar, chain, ddtree@4, ddtree@8
    assert by_key["code", "ddtree", 8]["speedup_vs_ar"] == pytest.approx(3.0)
    macro = by_key["macro", "ddtree", 8]
    assert macro["tau"] == pytest.approx(2.6) and macro["tokens_per_s"] == pytest.approx(187.5)
    assert macro["speedup_vs_ar"] == pytest.approx((3.0 + 1.5) / 2) and macro["n_prompts"] == 4
    assert [r["dataset"] for r in summary][-4:] == ["macro"] * 4


def test_auto_budget_rows_sort_after_fixed_budgets():
    rows = summarize(ROWS + [row("code", "ddtree", "auto", 210.0, 2.7, mean_budget=5.5)])
    code = [(r["method"], r["budget"]) for r in rows if r["dataset"] == "code"]
    assert code == [("ar", None), ("chain", 3), ("ddtree", 4), ("ddtree", 8), ("ddtree", "auto")]


def test_a_single_dataset_has_no_macro_row():
    assert all(r["dataset"] != "macro" for r in summarize(ROWS[:4]))


def test_markdown_and_csv_summaries(tmp_path):
    summary = write_summary(tmp_path, ROWS)
    md = (tmp_path / "summary.md").read_text()
    assert "| code | ddtree | 4 | 0 | - | 2.50 | 200.0 | 2.00x | 20% / 5% / 70% | True |" in md
    assert "| macro | chain | 3 | 0 | - | 1.75 | 125.0 | 1.75x | - | True |" in md
    table = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert len(table) == len(summary) and table[0]["experiment"] == "toy" and "accept_hist" not in table[0]
    assert markdown_table(summary) + "\n" == md


def _sampled(rows: list[dict], seed: int, tau_shift: float) -> list[dict]:
    return [{**r, "temperature": 1.0, "sampling": "rrs", "seed": seed, "tau": r["tau"] + tau_shift} for r in rows]


def test_sampling_seeds_are_separate_rows_and_macro_gives_their_spread():
    summary = summarize(_sampled(ROWS, 0, 0.0) + _sampled(ROWS, 1, 0.2) + _sampled(ROWS, 2, 0.4))
    assert len([r for r in summary if r["dataset"] == "code" and r["method"] == "ddtree"]) == 6  # 2 budgets x 3 seeds
    macro = {(r["method"], r["budget"]): r for r in summary if r["dataset"] == "macro"}
    assert macro["ddtree", 8]["tau"] == pytest.approx(2.6 + 0.2) and macro["ddtree", 8]["n_seeds"] == 3
    assert macro["ddtree", 8]["tau_std_over_seeds"] == pytest.approx(0.2)  # per-seed macros 2.6, 2.8, 3.0
    assert "| macro | ddtree | 8 | 1 | 3 seeds | 2.80 ± 0.20 |" in markdown_table(summary)
    one_seed = summarize(_sampled(ROWS, 5, 0.0))
    assert "| code | ddtree | 8 | 1 | 5 | 3.00 |" in markdown_table(one_seed)
    assert all(r.get("tau_std_over_seeds") is None for r in one_seed)


@pytest.mark.parametrize("field,value,shift,label", [
    ("draft_temperature", 0.8, 0.3, "ddtree, draft T=0.8 | 8 | 1 | - | 2.90"),
    ("fixed_children", 2, 0.1, "ddtree, 2 fixed | 8 | 1 | - | 2.70"),
])
def test_a_tree_drawing_setting_is_its_own_measurement(field, value, shift, label):
    plain, other = _sampled(ROWS, 0, 0.0), [{**r, field: value} for r in _sampled(ROWS, 0, shift)]
    summary = summarize(plain + other)
    macro = {(r["method"], r["budget"], r[field]): r["tau"] for r in summary if r["dataset"] == "macro"}
    assert macro["ddtree", 8, None] == pytest.approx(2.6) and macro["ddtree", 8, value] == pytest.approx(2.6 + shift)
    assert f"| macro | {label} |" in markdown_table(summary)


def test_figures_plot_the_mean_over_seeds():
    merged = mean_over_seeds(_sampled(ROWS, 0, 0.0) + _sampled(ROWS, 1, 0.2))
    assert len(merged) == len(ROWS)
    ddtree = next(r for r in merged if r["dataset"] == "code" and r["budget"] == 8)
    assert ddtree["tau"] == pytest.approx(3.1) and ddtree["n_seeds"] == 2 and ddtree["accept_hist"] == [6, 4, 2, 0]
    tau = plots.tau_vs_budget(summarize(_sampled(ROWS, 0, 0.0) + _sampled(ROWS, 1, 0.2)))
    assert [list(line.get_xdata()) for line in tau.axes[0].lines] == [[3], [4, 8]]  # chain, ddtree: once per budget


def _append_one(args: tuple[Path, int]) -> None:
    path, i = args
    append_rows(path, [row(f"set{i}", "ar", None, 1.0)])


def test_concurrent_appends_keep_every_row(tmp_path):
    path = tmp_path / "results.jsonl"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(_append_one, [(path, i) for i in range(16)])
    assert sorted(r["dataset"] for r in read_rows(path)) == sorted(f"set{i}" for i in range(16))
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_result_figures(tmp_path):
    summary = summarize(ROWS + [{**r, "temperature": 1.0} for r in ROWS])  # two temperatures: a series each
    paths = plots.write_figures(summary, tmp_path, "toy")
    assert sorted(p.name for p in paths) == ["acceptance.png", "speedup.png", "tau_vs_budget.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    tau = plots.tau_vs_budget(summary)
    assert [ax.get_title() for ax in tau.axes if ax.get_visible()] == ["chat", "code", "macro"]
    assert {line.get_label() for line in tau.axes[0].lines} == {"chain, T=0", "ddtree, T=0", "chain, T=1", "ddtree, T=1"}
    speedup = plots.speedup_bars(summarize(ROWS))
    assert {t.get_text() for t in speedup.axes[0].get_legend().get_texts()} == {"AR", "chain (budget 3)", "ddtree (budget 8)"}  # best mean speedup: 1.65x vs 1.5x


def test_only_figures_with_data_are_made():
    assert list(plots.result_figures([row("code", "ar", None, 100.0)], "toy")) == []


def test_gdn_verify_cost_figure(tmp_path):
    points = [{"T": 32, "per_branch_ms": 128.7, "parallel_ms": 3.6}, {"T": 16, "per_branch_ms": 66.0, "parallel_ms": 2.3}]
    fig = plots.gdn_verify_cost(points)
    assert isinstance(fig, Figure) and [t.get_text() for t in fig.axes[0].texts] == ["28.7x", "35.7x"]
    assert plots.save_figure(fig, tmp_path / "gdn.png").stat().st_size > 0


def _wandb_cfg(root: Path, mode: str = "offline", eval_wandb: bool = True):
    return OmegaConf.create({"experiment": "toy", "paths": {"root": str(root)}, "eval": {"wandb": eval_wandb},
                             "wandb": {"enabled": True, "mode": mode, "project": "weaver"}})


def test_wandb_switches():
    assert wandb_enabled(_wandb_cfg(Path("x")))
    assert not wandb_enabled(_wandb_cfg(Path("x"), eval_wandb=False))
    assert not wandb_enabled(_wandb_cfg(Path("x"), mode="disabled"))


def test_wandb_logs_an_offline_run(tmp_path):
    png = plots.save_figure(plots.tau_vs_budget(summarize(ROWS)), tmp_path / "tau_vs_budget.png")
    run_dir = log_eval_run(_wandb_cfg(tmp_path), summarize(ROWS), [png])
    assert run_dir.parent == tmp_path / "wandb" / "wandb" and run_dir.name.startswith("offline-run-")
    assert list(run_dir.glob("*.wandb")) and list(run_dir.glob("files/media/table/results_*.table.json"))
