"""One flat description of a supported target architecture, read from a transformers config.

Our model code branches on these fields only, never on `model_type` strings, so adding an architecture
means adding one `from_hf` case here and its weight mapping in `checkpoint.py`.
"""

from __future__ import annotations

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

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()


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
