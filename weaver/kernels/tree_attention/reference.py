"""Torch path of tree attention: SDPA with the explicit mask [valid prefix | ancestors-or-self]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestors: torch.Tensor, prefix_valid: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q (B, Hq, T, D), k/v (B, Hkv, P+T, D) with the T tree nodes last; returns (B, Hq, T, D)."""
    B, _, T, _ = q.shape
    P = k.shape[2] - T
    prefix = q.new_ones(B, T, P, dtype=torch.bool) if prefix_valid is None else prefix_valid[:, None, :P].expand(B, T, P)
    mask = torch.cat([prefix, ancestors[None].expand(B, T, T)], dim=-1)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
