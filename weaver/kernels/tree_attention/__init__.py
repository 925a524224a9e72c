"""Tree attention: queries are the T tree nodes, keys the prefix then the nodes themselves; a node sees
the valid prefix and its ancestors-or-self. Serves the target's attention layers during verification
(prefix = the KV cache) and the adapter's indexed attention (prefix = its prefix memory)."""

from __future__ import annotations

import torch

from ..dispatch import ParentTree, check_precomputed, flatten_trees, trees_for_reference, use_triton
from .reference import tree_attention_ref


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parents: torch.Tensor | ParentTree, *,
    prefix_valid: torch.Tensor | None = None, mask: torch.Tensor | None = None, scale: float | None = None,
    dot_precision: str = "ieee", ancestors: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, Hq, T, D); k, v (B, Hkv, P+T, D): P prefix slots then the T nodes in `parents` order
    (node-local, -1 = child of the prefix; one tree shared by the batch), or a tree object (`ParentTree`). prefix_valid (B, >=P) bool marks
    usable prefix slots (None: all). `mask`: the tree's ancestor bitmask if already built.
    `ancestors`: the (T, T) ancestors-or-self matrix of a tree object the caller holds (checked when it was
    built): the torch path then runs on it with no host work, so a compiled verify pass traces it.
    Returns (B, Hq, T, D) in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if ancestors is not None and not use_triton(q):
        check_precomputed(ancestors, q.shape[2], "ancestors")
        return tree_attention_ref(q, k, v, ancestors, prefix_valid, scale)
    flat_parents, cu_seqlens, lengths = flatten_trees(1, q.shape[2], parents, None)
    if use_triton(q):
        from .kernel import tree_attention_triton
        from ..tree_mask.kernel import tree_ancestor_mask_triton

        if mask is None:  # the tree is checked already
            mask = tree_ancestor_mask_triton(flat_parents, cu_seqlens, max(lengths))
        return tree_attention_triton(q, k, v, mask, prefix_valid, scale, dot_precision)
    ancestors = trees_for_reference(parents, flat_parents, cu_seqlens)[0].ancestors
    return tree_attention_ref(q, k, v, ancestors, prefix_valid, scale)


__all__ = ["tree_attention"]
