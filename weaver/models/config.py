"""One flat description of a supported target architecture, read from a transformers config.

Our model code branches on these fields only, never on `model_type` strings, so adding an architecture
means adding one `from_hf` case here and its weight mapping in `checkpoint.py`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from weaver.errors import WeaverError

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_5_text", "qwen3_5")


@dataclass(frozen=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # "full_attention" | "linear_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    inv_freq: torch.Tensor = field(repr=False)  # RoPE inverse frequencies (rotary part only)
    rope_scaling: float = 1.0
    attention_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3, qwen3.5)
    attn_output_gate: bool = False  # q_proj also emits a sigmoid gate on the attention output (qwen3.5)
    norm_offset: float = 0.0  # RMSNorm scale is (offset + weight): 1.0 for qwen3.5's zero-centred norms
    # Gated DeltaNet (linear_attention) layers
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    max_position_embeddings: int | None = None  # the context the checkpoint was made for (None: unbounded)

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types


def text_config(hf: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) config, e.g. Qwen3.5/3.6 VLM checkpoints."""
    return getattr(hf, "text_config", None) or hf


def _rope(hf: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params: dict[str, Any] = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return inv_freq.float(), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise WeaverError(f"rope_type '{rope_type}' changes with sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # yarn, llama3, linear: static tables

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)


def from_hf(hf: PretrainedConfig) -> TargetConfig:
    """Translate a transformers config into a TargetConfig, refusing unsupported architectures clearly."""
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise WeaverError(
            f"unsupported model_type '{hf.model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    tc = text_config(hf)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    inv_freq, scaling = _rope(tc, head_dim)
    qwen35 = hf.model_type in ("qwen3_5", "qwen3_5_text")
    layer_types = tuple(tc.layer_types) if qwen35 else ("full_attention",) * tc.num_hidden_layers
    common = dict(
        model_type=hf.model_type,
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_layers=tc.num_hidden_layers,
        layer_types=layer_types,
        num_heads=tc.num_attention_heads,
        num_kv_heads=tc.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=tc.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False)),
        inv_freq=inv_freq,
        rope_scaling=scaling,
        attention_bias=bool(getattr(tc, "attention_bias", False)),
        qk_norm=hf.model_type != "llama",
        max_position_embeddings=_positive_int_or_none(getattr(tc, "max_position_embeddings", None)),
    )
    if getattr(tc, "hidden_act", "silu") != "silu":
        raise WeaverError(f"hidden_act '{tc.hidden_act}' is not supported (only silu)")
    if not qwen35:
        return TargetConfig(**common)
    return TargetConfig(
        **common,
        attn_output_gate=True,
        norm_offset=1.0,
        linear_num_key_heads=tc.linear_num_key_heads,
        linear_num_value_heads=tc.linear_num_value_heads,
        linear_key_head_dim=tc.linear_key_head_dim,
        linear_value_head_dim=tc.linear_value_head_dim,
        linear_conv_kernel=tc.linear_conv_kernel_dim,
    )


def _positive_int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, numbers.Integral) and value > 0 else None


def is_count(value: Any, minimum: int = 1) -> bool:
    """A whole number (not a bool, not a float) of at least `minimum`."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def is_finite_number(value: Any) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_context(cfg: TargetConfig, prompt_len: int, max_new_tokens: int, what: str = "prompt") -> None:
    """Refuse a request that does not fit the target's context (`max_position_embeddings`, when the config
    has one): the prompt alone, or the prompt plus the tokens asked for."""
    if not is_count(max_new_tokens, 0):
        raise WeaverError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    limit = cfg.max_position_embeddings
    if limit is None:
        return
    if prompt_len > limit:
        raise WeaverError(f"{what} of {prompt_len} tokens is longer than the target's context "
                          f"(max_position_embeddings {limit})")
    if prompt_len + max_new_tokens > limit:
        raise WeaverError(f"{what} of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the target's "
                          f"context (max_position_embeddings {limit})")


def check_prompt(cfg: TargetConfig, prompt: Sequence[int], max_new_tokens: int) -> None:
    """One prompt for the target: at least one token, every id inside the vocabulary, and room for the
    tokens asked for within the target's context. O(len(prompt)) on the host."""
    if len(prompt) == 0:
        raise WeaverError("every prompt must contain at least one token")
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        bad = next(t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool))
        raise WeaverError(f"prompt tokens must be integer ids, got {bad!r}")
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= cfg.vocab_size:
        raise WeaverError(f"prompt token id {low if low < 0 else high} is outside the target's vocabulary "
                          f"(0..{cfg.vocab_size - 1})")
    check_context(cfg, len(prompt), max_new_tokens)
