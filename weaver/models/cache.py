"""Decode cache: static KV buffers for attention layers, conv + recurrent state for GDN layers.

All rows of a batch share one slot counter (`length`); prompts of different lengths are left-padded
and `valid` marks which slots hold real tokens. Left padding is exact for GDN layers too: padded
inputs are zeroed, so they add nothing to a state that starts at zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weaver.errors import WeaverError
from weaver.models.config import TargetConfig


@dataclass
class ModelCache:
    keys: list[torch.Tensor | None]  # per layer (B, H_kv, max_len, D) for attention layers (float64 for exact bf16)
    values: list[torch.Tensor | None]
    conv: list[torch.Tensor | None]  # per layer (B, conv_dim, kernel - 1) for GDN layers (float64 for exact bf16)
    recurrent: list[torch.Tensor | None]  # per layer (B, HV, d_k, d_v) for GDN layers, fp32 (float64 for exact bf16)
    valid: torch.Tensor  # (B, max_len) bool: slot holds a real token
    next_position: torch.Tensor  # (B,) position id of each row's next token
    length: int = 0  # slots used so far, shared by all rows
    padded: bool = False  # some row has padding slots (needs an explicit attention mask)

    @classmethod
    def empty(
        cls, cfg: TargetConfig, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
        cache_dtype: torch.dtype | None = None,
    ) -> "ModelCache":
        """Empty buffers for `max_len` slots: every buffer in `cache_dtype` if given (float64 for an exact bf16
        target, `TargetModel.new_cache`), else keys, values and conv windows in `dtype` and GDN states in fp32."""
        buffer_dtype = cache_dtype or dtype
        keys, values, conv, recurrent = [], [], [], []
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        for kind in cfg.layer_types:
            attn = kind == "full_attention"
            kv_shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
            keys.append(torch.zeros(kv_shape, dtype=buffer_dtype, device=device) if attn else None)
            values.append(torch.zeros(kv_shape, dtype=buffer_dtype, device=device) if attn else None)
            conv.append(None if attn else torch.zeros(batch_size, conv_dim, cfg.linear_conv_kernel - 1, dtype=buffer_dtype, device=device))
            recurrent.append(
                None
                if attn
                else torch.zeros(
                    batch_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                    dtype=cache_dtype or torch.float32, device=device,
                )
            )
        return cls(
            keys, values, conv, recurrent,
            valid=torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
            next_position=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def reserve(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise WeaverError(f"cache overflow: {self.length} + {n} tokens > max_len {self.max_len}")
