"""The SGLang plugin's tests (tests/serving_sglang) run against the real SGLang in its own environment,
.venv-sglang, which `bash scripts/install.sh --serve` builds (SGLang pins a torch of its own)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from hf_tiny import save_tiny_hf_model
from safetensors.torch import save_file
from serving_sglang.checkpoints import (
    ADAPTER, DRAFT_STEP, DRAFTER, MAX_NEW_TOKENS, NUM_DRAFT_TOKENS, REFERENCE, SAMPLED_PROMPT, SAMPLED_TEMPERATURE, TARGET,
    prompts,
)
from weaver.builders import ddtree
from weaver.engine import speculative_generate
from weaver.models.adapter import AdapterConfig, WeaverAdapter, save_adapter
from weaver.models.checkpoint import load_target
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config, save_drafter
from weaver.serving.sglang import TRACE_TOP

SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def test_the_plugin_imports_without_sglang():
    """weaver itself never needs SGLang: the plugin imports it only when SGLang calls `register`."""
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['sglang'] = None; "
                          "import weaver.serving.sglang, weaver.serving.sglang.tree_inputs"], capture_output=True)
    assert run.returncode == 0, run.stderr.decode()


def checkpoints(folder) -> dict[str, str]:
    """A tiny Qwen3 target, a DFlash drafter and a Weaver adapter for it with random weights, written by weaver,
    one drafting step and weaver's own engine on the serving tests' requests, computed here (handed to
    tests/serving_sglang in the environment variables its checkpoints.py names)."""
    torch.manual_seed(0)  # the same random models every run
    save_tiny_hf_model("qwen3", folder / "target")
    target = load_target(str(folder / "target"))
    config = new_drafter_config(target, 2, 8, 3, target_layer_ids=(0,))  # SGLang cannot tap the last layer
    drafter = Drafter(drafter_config(config))
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(std=0.3)  # no zero- or one-initialised tensor that a skipped weight would equal by chance
        drafter.norm.weight.mul_(40)  # peaked block logits (the tiny target's lm_head is small): no near-ties
    save_drafter(drafter, config, folder / "drafter")
    save_file(drafting_step(target, drafter), folder / "draft_step.safetensors")
    adapter = WeaverAdapter(AdapterConfig(target.cfg.hidden_size, target.cfg.vocab_size, drafter.cfg.block_size - 1,
                                          d_model=32, num_heads=2, intermediate_size=64, rank=16, pool_size=16))
    with torch.no_grad():
        for param in adapter.parameters():
            param.normal_(std=0.3)
    save_adapter(adapter, folder / "adapter")
    (folder / "reference.json").write_text(json.dumps(reference_runs(target, drafter, adapter.eval())))
    return {TARGET: str(folder / "target"), DRAFTER: str(folder / "drafter"), ADAPTER: str(folder / "adapter"),
            DRAFT_STEP: str(folder / "draft_step.safetensors"), REFERENCE: str(folder / "reference.json")}


def reference_runs(target, drafter: Drafter, adapter: WeaverAdapter) -> dict[str, list[dict]]:
    """Weaver's own engine, greedy, on every request the SGLang workers serve: tokens, verify steps, drafts
    accepted, and per step the drafts accepted and the drafter's top logits per depth (what the workers'
    WEAVER_TRACE records)."""
    singles, batch = prompts(target.cfg.vocab_size)
    top_logits = []
    draft = drafter.draft
    drafter.draft = lambda *args, **kwargs: top_logits.append(d := draft(*args, **kwargs)) or d  # record each step
    runs = {}
    for method in ("ddtree", "weaver"):
        runs[method] = []
        for prompt in singles + batch:
            top_logits.clear()
            ids, stats = speculative_generate(target, drafter, prompt, MAX_NEW_TOKENS, method=method,
                                              budget=NUM_DRAFT_TOKENS - 1, adapter=adapter)
            runs[method].append({
                "prompt": prompt, "ids": ids, "steps": len(stats.accepted), "accepted": sum(stats.accepted),
                "per_step": stats.accepted, "top_logits": [d.logits[0].topk(TRACE_TOP).values.tolist() for d in top_logits],
            })
    del drafter.draft
    runs["sampled"] = token_marginals(target, SAMPLED_PROMPT, SAMPLED_TEMPERATURE)
    return runs


@torch.inference_mode()
def token_marginals(target, prompt: list[int], temperature: float) -> list[list[float]]:
    """The exact distributions of the 2nd and 3rd tokens sampled after `prompt`, summed over the tokens before
    them: one batched target forward per position."""
    vocab = target.cfg.vocab_size

    def probs(ids: list[list[int]]) -> torch.Tensor:
        return torch.softmax(target(torch.tensor(ids)).logits[:, -1].double() / temperature, -1)

    p12 = probs([prompt])[0][:, None] * probs([prompt + [t] for t in range(vocab)])  # (t1, t2)
    p3 = (p12.flatten()[:, None] * probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)])).sum(0)
    return [p12.sum(0).tolist(), p3.tolist()]


@torch.inference_mode()
def drafting_step(target, drafter: Drafter, context: int = 11, budget: int = 6) -> dict[str, torch.Tensor]:
    """Inputs and outputs of one drafting step in weaver's own environment: random tapped target states of
    `context` tokens, the drafter's block logits after the anchor, and the DDTree of `budget` nodes."""
    gen = torch.Generator().manual_seed(0)
    taps = [torch.randn(1, context, target.cfg.hidden_size, generator=gen) for _ in drafter.cfg.target_layer_ids]
    cache = drafter.new_cache(1, context)
    drafter.extend_context(cache, taps, torch.arange(context)[None])
    anchor = torch.tensor([5])
    logits = drafter.draft(target, cache, anchor, torch.tensor([context])).logits[0]
    tree = ddtree(int(anchor), logits, budget).tree
    return {"taps": torch.stack(taps), "anchor": anchor, "logits": logits, "tree_tokens": tree.tokens,
            "tree_parents": tree.parents}


def test_sglang_plugin_tests_pass_against_the_real_sglang(tmp_path):
    if not SGLANG_PYTHON.exists():
        pytest.fail("no SGLang environment: run `bash scripts/install.sh --serve` (the README's test command does)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1", **checkpoints(tmp_path)}
    run = subprocess.run([str(SGLANG_PYTHON), "-m", "pytest", "tests/serving_sglang", "-q", "--noconftest",
                          "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout.strip().splitlines()[-1], run.stdout[-3000:]
    print(run.stdout.strip().splitlines()[-1])  # "N passed ... in S s"
