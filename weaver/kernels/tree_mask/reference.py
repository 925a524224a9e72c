"""Ancestor bitmask in torch, from `weaver.kernels.dispatch.ParentTree.ancestors`."""

from __future__ import annotations

import torch

from ..dispatch import ParentTree


def tree_ancestor_mask_ref(parents: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(N, ceil(max T / 32)) int32: bit j % 32 of word j // 32 in row i is set when node j is an
    ancestor-or-self of node i (local indices within i's tree)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    words = -(-max(lengths) // 32)
    out = torch.zeros(int(cu_seqlens[-1]), words, dtype=torch.int64, device=parents.device)
    weights = 2 ** torch.arange(32, device=parents.device, dtype=torch.int64)
    for start, T in zip(cu_seqlens[:-1].tolist(), lengths):
        local = parents[start : start + T].long()
        anc = ParentTree(local).ancestors
        anc = torch.nn.functional.pad(anc, (0, 32 * words - T)).view(T, words, 32)
        out[start : start + T] = (anc.long() * weights).sum(-1)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)  # two's complement wrap into int32

