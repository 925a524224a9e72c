"""Tiny randomly initialised transformers models of every supported type, for equivalence tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3_5TextConfig, Qwen3Config

VOCAB = 97


def tiny_config(model_type: str, vocab_size: int = VOCAB) -> PretrainedConfig:
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
    )
    if model_type == "llama":
        return LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if model_type == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if model_type == "qwen3_5_text":
        return Qwen3_5TextConfig(
            **common, num_hidden_layers=4, tie_word_embeddings=False,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    raise ValueError(model_type)


def save_tiny_hf_model(model_type: str, folder: Path, vocab_size: int = VOCAB) -> torch.nn.Module:
    """Save a random transformers model; norms and gates are perturbed so that every weight matters."""
    hf = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(folder)
    return hf


def draft_vocab_drafter(target, block_size: int, size: int, seed: int, num_taps: int = 2):
    """A random drafter (one layer) that drafts from `size` random tokens of the target's vocabulary."""
    from weaver.models.drafter import Drafter
    from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = new_drafter_config(target, 1, block_size, target.cfg.vocab_size - 1, num_taps, draft_vocab_size=size)
    drafter = Drafter(drafter_config(cfg))
    drafter.draft_vocab.copy_(torch.randperm(target.cfg.vocab_size, generator=gen)[:size].sort().values)
    return drafter.eval(), cfg
