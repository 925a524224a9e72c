"""The paper-figure notebooks execute (nbclient) on the smoke evaluation, so they cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_on_smoke_results(path, smoke_eval, tmp_path, monkeypatch):
    gdn = tmp_path / "gdn_tree_verify.json"
    gdn.write_text(json.dumps([{"T": 16, "per_branch_ms": 66.0, "parallel_ms": 2.3}, {"T": 32, "per_branch_ms": 128.7, "parallel_ms": 3.6}]))
    monkeypatch.setenv("WEAVER_RESULTS", str(smoke_eval))  # the kernel inherits the environment
    monkeypatch.setenv("WEAVER_GDN_JSON", str(gdn))
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4  # τ vs budget, speedup, acceptance, GDN
    assert any("| macro |" in o.get("data", {}).get("text/markdown", "") for o in outputs)
