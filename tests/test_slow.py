"""Full-size end-to-end check (deselected by default; run with `python -m pytest -m slow`).

Trains the `tiny` pipeline if its artifacts are missing (about an hour on 2 cores), then checks that
chain and Weaver speculative decoding reproduce our greedy AR output on the tiny eval (3 datasets x 8
prompts x 128 tokens, every budget).
CI runs the same checks at smoke size (tests/test_pipeline.py).
"""

from __future__ import annotations

import json

import pytest

from test_pipeline import ROOT, run


@pytest.mark.slow
def test_tiny_pipeline_chain_is_lossless(tmp_path):
    outputs = ROOT / "outputs"
    assert run("train.py", outputs, "+experiment=tiny").returncode == 0
    done = run("eval.py", outputs, "+experiment=tiny", "eval.methods=[ar,chain,weaver]", f"eval.out_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    spec = [r for r in rows if r["method"] != "ar"]
    assert sum(r["n_prompts"] for r in spec if r["method"] == "chain") >= 20
    assert spec and all(r["greedy_match"] is True for r in spec)
