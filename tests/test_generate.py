"""Autoregressive decoding: our greedy equals transformers' greedy; batching and eos behave."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tiny import VOCAB, save_tiny_hf_model
from weaver.errors import WeaverError
from weaver.generate import generate
from weaver.models.checkpoint import load_target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid")
    torch.manual_seed(0)
    save_tiny_hf_model("qwen3_5_text", folder)
    return load_target(str(folder)), AutoModelForCausalLM.from_pretrained(folder).eval()


@torch.no_grad()
def test_greedy_equals_transformers_generate(models):
    ours, theirs = models
    prompt = torch.randint(3, VOCAB, (1, 12))
    ref = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
                          min_new_tokens=40, do_sample=False, pad_token_id=0)
    assert generate(ours, [prompt[0].tolist()], 40)[0] == ref[0, 12:].tolist()


def test_batched_left_padded_equals_single(models):
    ours, _ = models
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in (3, 17, 8)]
    batched = generate(ours, prompts, 24)
    assert batched == [generate(ours, [p], 24)[0] for p in prompts]


def test_eos_stops_and_is_kept(models):
    ours, _ = models
    prompt = torch.randint(3, VOCAB, (6,)).tolist()
    full = generate(ours, [prompt], 30)[0]
    eos = full[10]
    cut = generate(ours, [prompt], 30, eos_token_id=eos)[0]
    assert cut == full[: full.index(eos) + 1]


def test_sampling_is_reproducible_with_a_generator(models):
    ours, _ = models
    prompt = [5, 6, 7]
    a = generate(ours, [prompt], 20, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = generate(ours, [prompt], 20, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert a == b and a != generate(ours, [prompt], 20)


def test_empty_prompt_is_refused(models):
    with pytest.raises(WeaverError, match="at least one token"):
        generate(models[0], [[1, 2], []], 4)


@pytest.mark.parametrize("mode", [True, "max-autotune"])
def test_compiled_decode_equals_eager(models, mode):
    ours, _ = models
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in (4, 9)]
    assert generate(ours, prompts, 12, compiled=mode) == generate(ours, prompts, 12)


@pytest.mark.parametrize("mode", ["max_autotune", "reduce-overhead", 1])
def test_unknown_compile_mode_is_refused(models, mode):
    with pytest.raises(WeaverError, match="compile: expected false, true or one of"):
        generate(models[0], [[1, 2]], 4, compiled=mode)
