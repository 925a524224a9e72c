"""eval.py sweeps and errors at smoke size (models from the session's smoke pipeline, tests/conftest.py)."""

from __future__ import annotations

import json

from conftest import run_script


def test_multirun_jobs_append_to_one_results_file(smoke_outputs, tmp_path):
    done = run_script("eval.py", smoke_outputs, "-m", "+experiment=smoke", f"eval.out_dir={tmp_path}",
                      "eval.temperature=0,1", "eval.methods=[ar,chain]", "eval.max_new_tokens=16")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted((r["temperature"], r["method"]) for r in rows) == [(0.0, "ar"), (0.0, "chain"), (1.0, "ar"), (1.0, "chain")]
    sampled = [r for r in rows if r["temperature"] == 1.0]
    assert all(r["greedy_match"] is None and r["speedup_vs_ar"] > 0 for r in sampled)
    summary = (tmp_path / "summary.md").read_text()  # rebuilt from both jobs' rows
    assert "| heldout_code | chain | 7 | 0 |" in summary and "| heldout_code | chain | 7 | 1 |" in summary
    assert done.stdout.count("| dataset | method |") == 2  # each job prints its own table


def test_unreachable_hub_dataset_is_one_clear_line(smoke_outputs, tmp_path):
    done = run_script("eval.py", smoke_outputs, "+experiment=smoke", "eval.datasets=[gsm8k]", f"eval.out_dir={tmp_path}",
                      HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: hub dataset openai/gsm8k (split test) cannot be loaded")
