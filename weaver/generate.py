"""Autoregressive decoding with our target model: the baseline every speedup is measured against.

Batched prompts are left-padded (exact for attention and GDN layers, see `weaver.models.cache`) and read together by
`TargetModel.prefill`; in bf16 on a CPU that read uses the fast kernels, so a prompt's first token may depend on its
batch there (as fp32 products always may); batch 1, which the evaluation and the engine use, reads it alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weaver.acceptance import argmax
from weaver.errors import WeaverError
from weaver.models.compile import Compile
from weaver.models.config import check_prompt
from weaver.models.target import TargetModel


def sample_next(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from logits (B, V): argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return argmax(logits)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape (B, max_len), prompts right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise WeaverError("every prompt must contain at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long, device=device)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def generate(
    model: TargetModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    compiled: Compile = False,
) -> list[list[int]]:
    """New tokens for each prompt (stopping at eos, which is kept), at most `max_new_tokens` each.

    compiled: run the single-token steps through `torch.compile`, in that inductor mode (`TargetModel.decode_fn`).
    """
    for prompt in prompts:
        check_prompt(model.cfg, prompt, max_new_tokens)
    step = model.decode_fn(compiled)
    device = model.embed.weight.device
    ids, mask = left_pad(prompts, pad_id=0, device=device)
    cache = model.new_cache(len(prompts), ids.shape[1] + max_new_tokens)
    logits = model.prefill(ids, cache, attention_mask=mask).logits[:, -1]
    out = torch.empty(len(prompts), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    n = 0
    for n in range(1, max_new_tokens + 1):
        token = sample_next(logits, temperature, generator)
        out[:, n - 1] = token
        if eos_token_id is not None:
            done |= token == eos_token_id
            if bool(done.all()):
                break
        if n < max_new_tokens:
            logits = step(token[:, None], cache).logits[:, -1]
    return [until_eos(row[:n].tolist(), eos_token_id) for row in out]


def until_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """Tokens up to and including the first eos."""
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens
