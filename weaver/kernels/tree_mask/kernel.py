"""Ancestor bitmask of a batch of trees: a block of nodes walks its parent pointers up to the roots.

Built once per verify step and shared by every head and layer (GDN decay masks, tree attention, commits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_mask_kernel(parents, cu_seqlens, mask, NW: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    i_n, i_t = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    rows = i_t * BT + tl.arange(0, BT)
    row_ok = rows < eos - bos
    offs_w = tl.arange(0, BW)
    words = tl.zeros([BT, BW], dtype=tl.int32)
    node = tl.where(row_ok, rows, -1)
    while tl.max(node) >= 0:  # depth of the deepest node in the block; parents[i] < i ends the walk
        bit = tl.where(offs_w[None, :] == node[:, None] // 32, 1 << (node[:, None] % 32), 0)
        words |= tl.where(node[:, None] >= 0, bit, 0)
        node = tl.load(parents + bos + node, mask=node >= 0, other=-1)
    tl.store(mask + (bos + rows[:, None]) * NW + offs_w[None, :], words, mask=row_ok[:, None] & (offs_w[None, :] < NW))


def tree_ancestor_mask_triton(parents: torch.Tensor, cu_seqlens: torch.Tensor, T_max: int) -> torch.Tensor:
    """Trees checked by `weaver.kernels.dispatch.check_trees` (a cyclic parent pointer would never end the walk);
    T_max: the largest tree's node count."""
    NW, BT = triton.cdiv(T_max, 32), 32
    mask = torch.empty(parents.shape[0], NW, dtype=torch.int32, device=parents.device)
    grid = (cu_seqlens.numel() - 1, triton.cdiv(T_max, BT))
    _tree_mask_kernel[grid](parents, cu_seqlens, mask, NW=NW, BT=BT, BW=triton.next_power_of_2(NW))
    return mask
