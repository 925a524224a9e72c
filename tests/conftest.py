import sys

# fla's Triton kernels fail on a CPU box; transformers picks them up at import time when fla is installed.
# Hide fla from transformers so its reference path (pure torch) is what we compare against.
sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
