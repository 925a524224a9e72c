"""Full-size end-to-end check (deselected by default; run with `python -m pytest -m slow`).

Trains the `tiny` pipeline if its artifacts are missing (about 40 minutes on 2 cores), then checks that
chain speculative decoding reproduces our greedy AR output for 20 prompts x 128 tokens.
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
    done = run("eval.py", outputs, "+experiment=tiny", "eval.methods=[ar,chain]", f"eval.out_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert rows["chain"]["n_prompts"] >= 20 and rows["chain"]["greedy_match"] is True
