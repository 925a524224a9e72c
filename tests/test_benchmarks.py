"""Benchmark scripts run at a toy size, so they cannot rot (their speed figures come from full runs)."""

from __future__ import annotations

import subprocess
import sys

from test_pipeline import ROOT


def test_gdn_tree_verify_benchmark_runs():
    args = ["--sizes", "4", "9", "--heads", "2", "--value-heads", "4", "--dim", "8", "--repeats", "1", "--threads", "1"]
    done = subprocess.run([sys.executable, "benchmarks/gdn_tree_verify.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 4 ") or line.startswith("| 9 ")]
    assert len(rows) == 2
