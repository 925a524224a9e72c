import os
import subprocess
import sys
from pathlib import Path

# The kernel tests run Triton's CPU interpreter. If Triton is first imported without the flag (importing
# torch._dynamo during collection does it), its kernels later fail in the interpreter ("Cannot call @triton.jit'd
# outside of the scope of a kernel"): so set it for the session, first thing (a GPU run sets it to 0).
os.environ.setdefault("TRITON_INTERPRET", "1")

# fla's Triton kernels fail on a CPU box; transformers picks them up at import time when fla is installed.
# Hide fla from transformers so its reference path (pure torch) is what we compare against.
sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models, thousands of tiny ops: intra-op threads only add overhead, and they stall badly (about
# 8 ms per op) when another process holds one of the cores, as the other test workers (pytest-xdist, one
# per core) do. So one thread here and in the train.py / eval.py processes the tests start.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3"])
def target(request, tmp_path_factory):
    """A random tiny hybrid (GDN + attention) and a dense-attention target, loaded by our code."""
    from hf_tiny import save_tiny_hf_model
    from weaver.models.checkpoint import load_target

    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    save_tiny_hf_model(request.param, folder)
    return load_target(str(folder))


ROOT = Path(__file__).resolve().parents[1]

# these run inside the SGLang environment (tests/test_serving.py starts them there)
collect_ignore = ["serving_sglang"]


def run_script(script: str, outputs: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    """Run train.py or eval.py with its artifacts under `outputs`, W&B off unless `env` says otherwise."""
    env = {**os.environ, "WEAVER_OUTPUTS": str(outputs), "WANDB_MODE": "disabled", **env}
    return subprocess.run([sys.executable, script, *overrides], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.fixture(scope="session")
def smoke_outputs(tmp_path_factory) -> Path:
    """The smoke pipeline (train.py +experiment=smoke, about 30 s), trained once per test session."""
    outputs = tmp_path_factory.mktemp("outputs")
    done = run_script("train.py", outputs, "+experiment=smoke")
    assert done.returncode == 0, done.stderr[-3000:]
    return outputs


@pytest.fixture(scope="session")
def smoke_eval(smoke_outputs, tmp_path_factory) -> Path:
    """An eval folder of the smoke models on three prompt sets (AR, chain, DDTree at two budgets), as notebooks read it."""
    out_dir = tmp_path_factory.mktemp("smoke_eval")
    done = run_script("eval.py", smoke_outputs, "+experiment=smoke", f"eval.out_dir={out_dir}",
                      "eval.datasets=[heldout_code,humaneval,gsm_symbolic]", "eval.methods=[ar,chain,ddtree,weaver]")
    assert done.returncode == 0, done.stderr[-3000:]
    return out_dir
