"""Torch path of the tree conv ops: `weaver.models.gdn.tree_causal_conv1d`, applied tree by tree."""

from __future__ import annotations

import torch

from weaver.models.gdn import tree_causal_conv1d, tree_conv_state
from weaver.tree import Tree


def tree_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, trees: list[Tree],
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """x (N, C) flattened trees; tree n continues the conv state in slot state_indices[n]."""
    outs = []
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        slot = int(state_indices[n])
        conv_index = trees[n].conv_index(weight.shape[1])
        outs.append(tree_causal_conv1d(x[None, start:end], weight, state[slot : slot + 1], conv_index)[0][0])
    return torch.cat(outs)


def tree_conv_commit_ref(
    state: torch.Tensor, x: torch.Tensor, state_indices: torch.Tensor, trees: list[Tree], cu_seqlens: torch.Tensor,
    leaves: list[int],
) -> None:
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        slot = int(state_indices[n])
        buffer = torch.cat([state[slot], x[start:end].T], dim=-1)
        state[slot].copy_(tree_conv_state(buffer, trees[n].conv_index(state.shape[-1] + 1), leaves[n]))
