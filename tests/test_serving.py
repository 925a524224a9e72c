"""The SGLang plugin's tests (tests/serving_sglang) run against the real SGLang in its own environment,
.venv-sglang, which `bash scripts/install.sh --serve` builds (SGLang pins a torch of its own)."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from hf_tiny import save_tiny_hf_model
from serving_sglang.checkpoints import DRAFTER, TARGET
from weaver.models.checkpoint import load_target
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config, save_drafter

SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def test_the_plugin_imports_without_sglang():
    """weaver itself never needs SGLang: the plugin imports it only when SGLang calls `register`."""
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['sglang'] = None; "
                          "import weaver.serving.sglang, weaver.serving.sglang.tree_inputs"], capture_output=True)
    assert run.returncode == 0, run.stderr.decode()


def checkpoints(folder) -> dict[str, str]:
    """A tiny Qwen3 target and a DFlash drafter for it with random weights, written by weaver (handed to
    tests/serving_sglang in the environment variables its checkpoints.py names)."""
    save_tiny_hf_model("qwen3", folder / "target")
    config = new_drafter_config(load_target(str(folder / "target")), 2, 8, 3, num_taps=2)
    drafter = Drafter(drafter_config(config))
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_()  # no zero- or one-initialised tensor that a skipped weight would equal by chance
    save_drafter(drafter, config, folder / "drafter")
    return {TARGET: str(folder / "target"), DRAFTER: str(folder / "drafter")}


def test_sglang_plugin_tests_pass_against_the_real_sglang(tmp_path):
    if not SGLANG_PYTHON.exists():
        pytest.fail("no SGLang environment: run `bash scripts/install.sh --serve` (the README's test command does)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1", **checkpoints(tmp_path)}
    run = subprocess.run([str(SGLANG_PYTHON), "-m", "pytest", "tests/serving_sglang", "-q", "--noconftest",
                          "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout.strip().splitlines()[-1], run.stdout[-3000:]
    print(run.stdout.strip().splitlines()[-1])  # "N passed ... in S s"
