"""The SGLang plugin's tests (tests/serving_sglang) run against the real SGLang in its own environment,
.venv-sglang, which `bash scripts/install.sh --serve` builds (SGLang pins a torch of its own)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def test_the_plugin_imports_without_sglang():
    """weaver itself never needs SGLang: the plugin imports it only when SGLang calls `register`."""
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['sglang'] = None; "
                          "import weaver.serving.sglang, weaver.serving.sglang.tree_inputs"], capture_output=True)
    assert run.returncode == 0, run.stderr.decode()


def test_sglang_plugin_tests_pass_against_the_real_sglang():
    if not SGLANG_PYTHON.exists():
        pytest.fail("no SGLang environment: run `bash scripts/install.sh --serve` (the README's test command does)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1"}
    run = subprocess.run([str(SGLANG_PYTHON), "-m", "pytest", "tests/serving_sglang", "-q", "--noconftest",
                          "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    print(run.stdout.strip().splitlines()[-1])  # "N passed ... in S s"
