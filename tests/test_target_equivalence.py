"""Our target model must give transformers' logits for the same weights (fp32, 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache

from hf_tiny import VOCAB, save_tiny_hf_model
from weaver.errors import WeaverError
from weaver.models import checkpoint
from weaver.models.checkpoint import load_target, save_hf_checkpoint

TYPES = ["llama", "qwen3", "qwen3_5_text"]
TOL = 1e-4


@pytest.fixture(params=TYPES)
def pair(request, tmp_path):
    hf = save_tiny_hf_model(request.param, tmp_path)
    return hf, load_target(str(tmp_path)), tmp_path


@torch.no_grad()
def test_prefill_logits_match(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, VOCAB, (2, 71))  # > one GDN chunk of 64
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=TOL, rtol=0)


@torch.no_grad()
def test_incremental_decode_matches(pair):
    hf, ours, _ = pair
    prompt = torch.randint(0, VOCAB, (2, 9))
    hf_cache = DynamicCache(config=hf.config)
    ref = hf(prompt, cache=hf_cache, use_cache=True).logits[:, -1]
    cache = ours.new_cache(2, 32)
    got = ours(prompt, cache, logits_to_keep=1).logits[:, -1]
    for _ in range(12):
        torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
        nxt = ref.argmax(-1, keepdim=True)
        ref = hf(nxt, cache=hf_cache, use_cache=True).logits[:, -1]
        got = ours(nxt, cache).logits[:, -1]
    # a multi-token append onto a warm cache (the shape of a verify step)
    block = torch.randint(0, VOCAB, (2, 5))
    torch.testing.assert_close(ours(block, cache).logits, hf(block, cache=hf_cache, use_cache=True).logits, atol=TOL, rtol=0)


@torch.no_grad()
def test_left_padded_batch_equals_single_rows(pair):
    _, ours, _ = pair
    rows = [torch.randint(0, VOCAB, (n,)) for n in (5, 11)]
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, -len(row):], mask[r, -len(row):] = row, 1
    cache = ours.new_cache(2, 20)
    batched = [ours(ids, cache, attention_mask=mask).logits[:, -1]]
    nxt = batched[0].argmax(-1, keepdim=True)
    batched.append(ours(nxt, cache).logits[:, -1])
    for r, row in enumerate(rows):
        single = ours(torch.cat([row, nxt[r]])[None]).logits[0]
        torch.testing.assert_close(batched[0][r], single[-2], atol=TOL, rtol=0)
        torch.testing.assert_close(batched[1][r], single[-1], atol=TOL, rtol=0)


@torch.no_grad()
@torch.no_grad()
def test_bf16_target_rotates_by_transformers_angles(pair):
    """In bf16 the RoPE inverse frequencies stay fp32, as in transformers: cast to bf16 they are 0.2% off,
    about a radian by position 500, and a long context's logits drift away from transformers'."""
    _, _, folder = pair
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ours = load_target(str(folder), dtype=torch.bfloat16)
    positions = torch.arange(0, 4096, 7)[None]
    want = hf.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), positions)
    for got, ref in zip(ours.rope(positions), want):
        assert got.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(got[:, :, 0].float(), ref.float(), atol=8e-3, rtol=0)  # one bf16 rounding


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path):
    hf, ours, folder = pair
    save_hf_checkpoint(ours, hf.config, tmp_path / "resaved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved").eval()
    ids = torch.randint(0, VOCAB, (1, 20))
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=TOL, rtol=0)


@torch.no_grad()
def test_perturbed_weight_mapping_is_caught(pair, monkeypatch):
    """The equivalence check must fail if the weight table fuses tensors in the wrong order."""
    hf, _, folder = pair
    original = checkpoint.weight_table

    def swapped(cfg):
        return [(ours, names[::-1]) if "gate_up" in ours else (ours, names) for ours, names in original(cfg)]

    monkeypatch.setattr(checkpoint, "weight_table", swapped)
    wrong = load_target(str(folder))
    ids = torch.randint(0, VOCAB, (1, 20))
    assert (wrong(ids).logits - hf(ids).logits).abs().max() > 1e-2


@torch.no_grad()
def test_vlm_nested_checkpoint(tmp_path):
    """Qwen3.5/3.6 hub checkpoints nest the LM under model.language_model with a text_config."""
    hf = save_tiny_hf_model("qwen3_5_text", tmp_path / "flat")
    tensors = load_file(tmp_path / "flat" / "model.safetensors")
    nested = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    (tmp_path / "vlm").mkdir()
    save_file(nested, tmp_path / "vlm" / "model.safetensors")
    text = json.loads((tmp_path / "flat" / "config.json").read_text())
    text["model_type"] = "qwen3_5_text"
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
              "tie_word_embeddings": False}
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, VOCAB, (1, 16))
    torch.testing.assert_close(load_target(str(tmp_path / "vlm"))(ids).logits, hf(ids).logits, atol=TOL, rtol=0)


def test_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(WeaverError, match="not found"):
        load_target(str(tmp_path / "nope"))


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(WeaverError, match="unsupported model_type 'gpt2'"):
        load_target(str(tmp_path))


def test_corrupt_and_incomplete_checkpoints(tmp_path):
    save_tiny_hf_model("qwen3", tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, weights)
    with pytest.raises(WeaverError, match="lacks model.layers.1.mlp.up_proj.weight"):
        load_target(str(tmp_path))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(WeaverError, match="corrupt weights file"):
        load_target(str(tmp_path))


def test_rope_tables_are_float64_values_rounded_so_runs_reproduce():
    """RoPE cos/sin are the float64 values of the float32 angles, rounded. MKL's float32 cos/sin on CPU are
    not (a few in a thousand differ by an ulp) and vary with the thread that computes them: a worker thread's
    first calls in a process can take another path, so a forward, a training run or a stored-states shard was
    not bitwise the same from one process to the next (the resume tests failed now and then on it)."""
    import math

    from weaver.models.layers import rope_tables

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float()
    positions = torch.arange(2048)[None]
    cos, sin = rope_tables(positions, inv_freq, 1.0, torch.float32)
    angles = (positions[..., None].float() * inv_freq)[0].double().tolist()
    for table, fn in ((cos, math.cos), (sin, math.sin)):
        rounded = torch.tensor([[fn(a) for a in row] for row in angles], dtype=torch.float64).float()
        assert torch.equal(table[0, :, 0], torch.cat((rounded, rounded), dim=-1))
