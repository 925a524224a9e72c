"""GDN tree verification (fused) and rollback-free commit: one API, Triton or torch behind it.

Model code calls `gdn_tree_verify` then `gdn_tree_commit_`; `weaver.kernels.dispatch.use_triton` picks the
backend at verify time and the pending object carries the choice to the commit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dispatch import (
    KernelError, ParentTree, check_leaves, check_precomputed, flatten_trees, trees_for_reference, use_triton,
)
from .reference import (
    PendingGDN, gdn_gates, gdn_tree_commit_ref, gdn_tree_verify_ref, tree_gated_delta_rule,
)


@dataclass
class GDNTreePending:
    """What the commit needs; the committed state pool is untouched until then."""

    state_indices: torch.Tensor  # (n_trees,) pool slot of each tree
    layout: str  # "kv" (fla) or "vk" (SGLang)
    lengths: list[int]  # node count of each tree (host), to check the commit's leaves
    reference: list[PendingGDN] | None = None  # torch backend: one per tree
    # Triton backend: raw keys (N, H, K) (re-normalised at commit), U (N, HV, V), G (N, HV), tree data
    k: torch.Tensor | None = None
    U: torch.Tensor | None = None
    G: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    dot_precision: str = "ieee"


def gdn_tree_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, parents: torch.Tensor | ParentTree, *,
    cu_seqlens: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
    mask: torch.Tensor | None = None, scale: float | None = None, state_layout: str = "kv",
    dot_precision: str = "ieee", ancestors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, GDNTreePending]:
    """Outputs of every tree node, each continuing its own root-to-node path from the committed state.

    q, k (B, T, H, K) raw (normalised here); v (B, T, HV, V), HV a multiple of H; a, b (B, T, HV) raw gate
    projections: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); A_log, dt_bias (HV,).
    `state` is a pool (slots, HV, K, V) for state_layout "kv" (fla) or (slots, HV, V, K) for "vk"
    (SGLang); tree n reads slot state_indices[n] (default n). `parents` (T,) node-local, -1 for children
    of the context, shared by the B rows (or a tree object, `weaver.kernels.dispatch.ParentTree`, whose cached
    ancestors the torch path reuses);
    or a batch of trees: B = 1, parents (N,), `cu_seqlens` offsets. `mask`: the trees' ancestor bitmask
    for the Triton path if already built (it is shared by all layers and heads).
    `scale`: applied to q after its L2 norm (default K^-0.5), by both backends.
    `dot_precision`: Triton's tl.dot input_precision ("ieee" exact fp32; "tf32x3"/"tf32" faster on GPU).
    `ancestors`: the (T, T) ancestors-or-self matrix of the tree object given as `parents`: the torch path then
    does no host work (a compiled verify pass traces it).
    Returns o (B, T, HV, V) fp32 and the pending commit data. Trees not in topological order, empty ones
    and mismatched lengths raise `weaver.kernels.dispatch.TreeInputError` before anything runs.
    """
    B, T, H, K = k.shape
    HV = v.shape[2]
    if HV % H or state_layout not in ("kv", "vk"):
        raise KernelError(f"GDN tree verify: HV={HV} must be a multiple of H={H}, layout 'kv' or 'vk'")
    scale = K**-0.5 if scale is None else scale
    if ancestors is not None and not isinstance(parents, torch.Tensor) and cu_seqlens is None and state_indices is None \
            and not use_triton(v):
        check_precomputed(ancestors, T, "ancestors")
        return _verify_shared_tree(q, k, v, a, b, A_log, dt_bias, state, parents, ancestors, scale, state_layout)
    flat_parents, cu_seqlens, lengths = flatten_trees(B, T, parents, cu_seqlens)
    if state_indices is None:
        state_indices = torch.arange(cu_seqlens.numel() - 1, device=state.device)
    state_indices = state_indices.to(torch.int32)
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, a, b)]
    pending = GDNTreePending(state_indices, state_layout, lengths)
    if use_triton(v):
        from .kernel import gdn_tree_verify_triton
        from ..tree_mask.kernel import tree_ancestor_mask_triton

        if mask is None:  # the trees are checked already
            mask = tree_ancestor_mask_triton(flat_parents, cu_seqlens, max(lengths))
        o, pending.U, pending.G = gdn_tree_verify_triton(
            *flat, A_log, dt_bias, state, state_indices, mask, cu_seqlens, max(lengths), scale, state_layout,
            dot_precision,
        )
        pending.k, pending.mask, pending.cu_seqlens, pending.dot_precision = flat[1], mask, cu_seqlens, dot_precision
    else:
        o, pending.reference = gdn_tree_verify_ref(
            *flat, A_log, dt_bias, state, state_indices, trees_for_reference(parents, flat_parents, cu_seqlens),
            cu_seqlens, scale, state_layout,
        )
    return o.view(B, T, HV, -1), pending


def _verify_shared_tree(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, tree: ParentTree, ancestors: torch.Tensor, scale: float, layout: str,
) -> tuple[torch.Tensor, GDNTreePending]:
    """The torch path for one checked tree shared by the B rows (row n reads slot n), all rows at once."""
    B = q.shape[0]
    S0 = state[:B] if layout == "kv" else state[:B].transpose(-1, -2)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, p = tree_gated_delta_rule(q, k, v, g, beta, S0, ancestors, scale)
    slots = torch.arange(B, dtype=torch.int32, device=state.device)
    rows = [PendingGDN(p.k[n : n + 1], p.U[n : n + 1], p.G[n : n + 1], ancestors) for n in range(B)]
    return o, GDNTreePending(slots, layout, [len(tree)] * B, reference=rows)


def gdn_tree_commit_(state: torch.Tensor, pending: GDNTreePending, leaf: int | list[int] | torch.Tensor) -> None:
    """Write S_leaf = a_leaf S0 + sum_{j on path} D_leaf,j k_j u_j^T into each tree's slot, in place.

    `leaf`: the accepted path's last node, node-local, one per tree (an int for a single tree); out of
    range raises `weaver.kernels.dispatch.TreeInputError`.
    """
    leaves = check_leaves(leaf, pending.lengths)
    if pending.reference is not None:
        gdn_tree_commit_ref(state, pending.state_indices, pending.reference, leaves.tolist(), pending.layout)
        return
    from .kernel import gdn_tree_commit_triton

    gdn_tree_commit_triton(
        pending.k, pending.U, pending.G, state, pending.state_indices, pending.mask, pending.cu_seqlens,
        leaves.to(state.device), pending.layout, pending.dot_precision,
    )


__all__ = ["GDNTreePending", "gdn_tree_commit_", "gdn_tree_verify"]
