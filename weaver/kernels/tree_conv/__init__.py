"""Tree causal conv1d (the GDN mixer's short conv on a draft tree) and the commit of its window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dispatch import (
    ParentTree, check_leaves, check_precomputed, flatten_trees, shared_tree, trees_for_reference, use_triton,
)
from .reference import conv_windows, tree_causal_conv1d, tree_conv1d_ref, tree_conv_commit_ref


@dataclass
class TreeConvPending:
    """The verified inputs; the committed conv state is untouched until the commit."""

    x: torch.Tensor  # (N, C) conv inputs of every node
    parents: torch.Tensor  # (N,) int32, node-local
    cu_seqlens: torch.Tensor  # (n_trees + 1,) int32
    state_indices: torch.Tensor  # (n_trees,) int32
    lengths: list[int]  # node count of each tree (host), to check the commit's leaves
    trees: list[ParentTree] | None  # torch path: one tree object per tree (cached conv windows); None on the Triton path


def tree_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor | ParentTree, *,
    cu_seqlens: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
    conv_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TreeConvPending]:
    """SiLU(depthwise causal conv) of every node along its own ancestors. x (B, T, C), weight (C, W),
    state a pool (slots, C, W-1) of committed last inputs, tree n reading slot state_indices[n] (default
    n); parents / cu_seqlens as in `weaver.kernels.gdn_tree.gdn_tree_verify`. `conv_index`: `conv_windows(tree, W)`
    of the tree object given as `parents`: the torch path then does no host work (a compiled
    verify pass traces it). Returns out (B, T, C) in x's dtype."""
    B, T, C = x.shape
    if conv_index is not None and not isinstance(parents, torch.Tensor) and cu_seqlens is None and state_indices is None \
            and not use_triton(x):
        check_precomputed(conv_index, T, "conv_index")
        out, _ = tree_causal_conv1d(x, weight, state[:B], conv_index)
        flat_parents, cu_seqlens, lengths = shared_tree(B, parents.parents)
        slots = torch.arange(B, dtype=torch.int32, device=state.device)
        return out, TreeConvPending(x.reshape(B * T, C), flat_parents, cu_seqlens, slots, lengths, [parents] * B)
    flat_parents, cu_seqlens, lengths = flatten_trees(B, T, parents, cu_seqlens)
    if state_indices is None:
        state_indices = torch.arange(cu_seqlens.numel() - 1, device=state.device)
    trees = None if use_triton(x) else trees_for_reference(parents, flat_parents, cu_seqlens)
    pending = TreeConvPending(x.reshape(B * T, C).contiguous(), flat_parents, cu_seqlens, state_indices.to(torch.int32),
                              lengths, trees)
    if trees is None:
        from .kernel import tree_conv1d_triton

        out = tree_conv1d_triton(pending.x, weight.contiguous(), state, pending.state_indices, flat_parents, cu_seqlens,
                                 max(lengths))
    else:
        out = tree_conv1d_ref(pending.x, weight, state, pending.state_indices, trees, cu_seqlens)
    return out.view(B, T, C), pending


def tree_conv_commit_(state: torch.Tensor, pending: TreeConvPending, leaf: int | list[int] | torch.Tensor) -> None:
    """Write each tree's new conv state (the last W-1 inputs along its accepted path) into its slot."""
    leaves = check_leaves(leaf, pending.lengths)
    if pending.trees is None:
        from .kernel import tree_conv_commit_triton

        tree_conv_commit_triton(state, pending.x, pending.state_indices, pending.parents, pending.cu_seqlens,
                                leaves.to(state.device))
    else:
        tree_conv_commit_ref(state, pending.x, pending.state_indices, pending.trees, pending.cu_seqlens, leaves.tolist())


__all__ = ["TreeConvPending", "conv_windows", "tree_conv1d", "tree_conv_commit_"]
