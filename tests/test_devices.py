"""GPU-readiness without a GPU: every tensor the decoding paths create is placed on the model's device and
made in the model's dtype explicitly, so nothing silently stays on the CPU or in fp32 when the models live
on CUDA in bf16. A `TorchFunctionMode` sees each factory call as our code wrote it (before torch fills in
the default device) while AR and every speculative method decode with bf16 models.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_tiny import save_tiny_hf_model
from weaver.engine import speculative_generate
from weaver.generate import generate
from weaver.models.adapter import AdapterConfig, WeaverAdapter
from weaver.models.checkpoint import load_target
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "rand", "randn", "randint", "eye",
             "linspace", "scalar_tensor"}
# Host-side on purpose: tree and leaf validation run on the host (weaver/kernels/dispatch.py; the kernels move the
# leaves to the state's device); acceptance draws its uniform with the caller's (CPU) generator. fp32 on purpose: GDN
# recurrent states (fla keeps them in fp32), sampling probabilities and the tree search's (and the direct chain
# and DDTree builders') scores, priorities and Gumbel noise (drawn with the caller's generator, on its device,
# then moved).
HOST_SIDE = {("weaver/kernels/dispatch.py", "check_trees"), ("weaver/kernels/dispatch.py", "check_leaves"),
             ("weaver/acceptance.py", "recursive_rejection_tree"), ("weaver/acceptance.py", "settle")}
FP32_ON_PURPOSE = {("weaver/models/cache.py", "empty"), ("weaver/acceptance.py", "recursive_rejection_tree"),
                   ("weaver/acceptance.py", "settle"),
                   ("weaver/search.py", "start"), ("weaver/search.py", "__init__"), ("weaver/search.py", "ranked_children"),
                   ("weaver/builders.py", "chain_tree"), ("weaver/static_trees.py", "best_paths_nodes"),
                   ("weaver/static_trees.py", "rescore_candidates")}


class FactoryAudit(TorchFunctionMode):
    """Counts factory calls from our code without a device taken from a tensor or model (none, or a literal
    string), and floating ones not in `dtype`."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.no_device: Counter = Counter()
        self.wrong_dtype: Counter = Counter()

    def _caller(self) -> tuple[str, str, str] | None:
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = Path(frame.filename)
            if ROOT in path.parents and "tests" not in path.parts:
                return str(path.relative_to(ROOT)), frame.name, frame.line
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in FACTORIES and (caller := self._caller()) is not None:
            device = kwargs.get("device")  # a literal "cpu" is as wrong on a GPU as no device at all
            if (device is None or isinstance(device, str)) and caller[:2] not in HOST_SIDE:
                self.no_device[caller] += 1
            if out.is_floating_point() and out.dtype != self.dtype and caller[:2] not in FP32_ON_PURPOSE:
                self.wrong_dtype[caller] += 1
        return out


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    """A hybrid (GDN + attention) target with a drafter and an adapter, all in bf16."""
    folder = tmp_path_factory.mktemp("hybrid")
    torch.manual_seed(0)
    save_tiny_hf_model("qwen3_5_text", folder)
    target = load_target(str(folder), torch.bfloat16)
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 4, 3, 2))).to(torch.bfloat16).eval()
    t = target.cfg
    adapter = WeaverAdapter(AdapterConfig(t.hidden_size, t.vocab_size, 3, 32, 1, 2, 64, 16, 8)).to(torch.bfloat16).eval()
    return target, drafter, adapter


def test_decoding_creates_every_tensor_on_the_models_device_and_dtype(bf16_models):
    target, drafter, adapter = bf16_models
    audit = FactoryAudit(torch.bfloat16)
    with audit:
        generate(target, [[1, 2, 3], [4, 5]], 4)
        for method in ("chain", "ddtree", "weaver", "oracle"):
            for temperature, sampling in ((0.0, "rrs"), (1.0, "rrs"), (1.0, "traversal"), (1.0, "target_only")):
                speculative_generate(target, drafter, [1, 2, 3, 4], 8, temperature, None,  # budget 3: a chain's most
                                     torch.Generator().manual_seed(0), method, 3, adapter=adapter, sampling=sampling)
    assert not audit.no_device, f"tensors created without device=: {dict(audit.no_device)}"
    assert not audit.wrong_dtype, f"floating tensors not in the models' dtype: {dict(audit.wrong_dtype)}"


def test_the_audit_catches_a_forgotten_device_and_dtype():
    """The check above can fail: a factory call from our code without device= (or in fp32) is reported."""
    from weaver import tree as tree_module  # any module of ours: the audit attributes calls by file

    audit = FactoryAudit(torch.bfloat16)
    with audit:
        code = "torch.arange(3); torch.ones(2, device='cpu', dtype=torch.bfloat16); torch.zeros(2, device=torch.device('cpu'))"
        exec(compile(code, tree_module.__file__, "exec"), {"torch": torch})
    assert sum(audit.no_device.values()) == 2 and sum(audit.wrong_dtype.values()) == 1
