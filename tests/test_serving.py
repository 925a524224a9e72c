"""The SGLang plugin's tests (tests/serving_sglang) run against the real SGLang in its own environment,
.venv-sglang, which `bash scripts/install.sh --serve` builds (SGLang pins a torch of its own)."""

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_script
from hf_tiny import save_tiny_hf_model
from safetensors.torch import save_file
from serving_sglang.checkpoints import (
    ADAPTER, DRAFT_STEP, DRAFTER, MAX_NEW_TOKENS, NUM_DRAFT_TOKENS, REFERENCE, SAMPLED_PROMPT, SAMPLED_TEMPERATURE, TARGET,
    prompts,
)
from weaver.builders import ddtree
from weaver.data.corpus import train_tokenizer
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
    # -o addopts=: not our suite's options (pytest-xdist workers), which .venv-sglang has no plugin for
    run = subprocess.run([str(SGLANG_PYTHON), "-m", "pytest", "tests/serving_sglang", "-q", "--noconftest", "-o", "addopts=",
                          "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout.strip().splitlines()[-1], run.stdout[-3000:]
    print(run.stdout.strip().splitlines()[-1])  # "N passed ... in S s"


def eval_checkpoints(folder) -> list[str]:
    """A tiny Qwen3 target with a BPE tokenizer of its own (what eval.py encodes prompts with), a random DFlash
    drafter and Weaver adapter for it: the overrides that point `+experiment=qwen3_8b` at them."""
    torch.manual_seed(0)
    source = Path(json.__file__).read_text()  # any text: a tokenizer the prompts can be encoded with
    tokenizer = train_tokenizer([source], 300)
    save_tiny_hf_model("qwen3", folder / "target", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder / "target")
    target = load_target(str(folder / "target"))
    config = new_drafter_config(target, 1, 4, tokenizer.mask_token_id, target_layer_ids=(0,))
    drafter = Drafter(drafter_config(config))
    adapter = WeaverAdapter(AdapterConfig(target.cfg.hidden_size, target.cfg.vocab_size, drafter.cfg.block_size - 1,
                                          d_model=32, num_heads=2, intermediate_size=64, rank=16, pool_size=16))
    with torch.no_grad():
        for param in [*drafter.parameters(), *adapter.parameters()]:
            param.normal_(std=0.3)
        drafter.norm.weight.mul_(40)
    save_drafter(drafter, config, folder / "drafter")
    save_adapter(adapter, folder / "adapter")
    return [f"model.path={folder / 'target'}", f"drafter.path={folder / 'drafter'}", f"weaver.path={folder / 'adapter'}"]


def test_eval_through_sglang_writes_the_rows_of_our_engine(tmp_path):
    """`eval.py eval.backend=sglang` on the same checkpoints and prompts as weaver's own engine: every row's
    output equals transformers' greedy decoding, and each method's τ (verify steps and drafts accepted)
    equals our engine's, at one and at two requests in flight."""
    if not SGLANG_PYTHON.exists():
        pytest.fail("no SGLang environment: run `bash scripts/install.sh --serve` (the README's test command does)")
    out = tmp_path / "eval"
    common = ["+experiment=qwen3_8b", *eval_checkpoints(tmp_path), "model.dtype=float32", "device=cpu",
              "eval.datasets=[humaneval]", "eval.n_prompts=3", "eval.prompt_tokens=24", "eval.max_new_tokens=12",
              "eval.methods=[ar,ddtree,weaver]", "eval.budgets=[3]", "eval.compile=false", "eval.check_transformers=true",
              f"eval.out_dir={out}"]
    done = run_script("eval.py", tmp_path, *common)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_script("eval.py", tmp_path, *common, "eval.backend=sglang", "eval.sglang.concurrency=[1,2]",
                      f"eval.sglang.cpu_stand_ins={ROOT / 'tests' / 'serving_sglang' / 'cpu_engine'}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    ours = {r["method"]: r for r in rows if r["backend"] == "torch"}
    served = [r for r in rows if r["backend"] == "sglang"]
    assert sorted((r["method"], r["concurrency"]) for r in served) == [(m, c) for m in ("ar", "ddtree", "weaver") for c in (1, 2)]
    for r in served:
        assert r["matches_transformers"] and r["greedy_match"], r
        assert r["tau"] == pytest.approx(ours[r["method"]]["tau"], abs=1e-12), (r, ours[r["method"]])
        assert r["speedup_vs_ar"] > 0 and r["n_tokens"] == ours[r["method"]]["n_tokens"]
    assert "weaver (sglang, 2 in flight)" in (out / "summary.md").read_text()
