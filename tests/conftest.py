import sys

# fla's Triton kernels fail on a CPU box; transformers picks them up at import time when fla is installed.
# Hide fla from transformers so its reference path (pure torch) is what we compare against.
sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models, thousands of tiny ops: intra-op threads only add overhead, and they stall badly (about
# 8 ms per op) when another process holds one of the two cores.
torch.set_num_threads(1)


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
