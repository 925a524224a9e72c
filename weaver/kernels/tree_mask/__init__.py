"""Ancestor bitmask of a batch of trees (the tree mask every other op reads)."""

from __future__ import annotations

import torch

from ..dispatch import flatten_trees, use_triton
from .reference import tree_ancestor_mask_ref


def tree_ancestor_mask(parents: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """(N, ceil(max T / 32)) int32 bit-packed ancestors-or-self rows; see `tree_ancestor_mask_ref`.

    `parents` (N,) are node-local (-1: child of the committed context); trees at `cu_seqlens` offsets
    (one tree when None). Bad trees raise `weaver.kernels.dispatch.TreeInputError` (see `check_trees`).
    """
    parents, cu_seqlens, lengths = flatten_trees(1, parents.numel(), parents, cu_seqlens)
    if use_triton(parents):
        from .kernel import tree_ancestor_mask_triton

        return tree_ancestor_mask_triton(parents, cu_seqlens, max(lengths))
    return tree_ancestor_mask_ref(parents, cu_seqlens)


__all__ = ["tree_ancestor_mask", "tree_ancestor_mask_ref"]
