"""Torch path of the GDN tree ops: the references in `weaver.models.gdn`, applied tree by tree."""

from __future__ import annotations

import torch

from weaver.models.gdn import PendingGDN, commit_path, gdn_gates, tree_gated_delta_rule
from weaver.tree import Tree


def gdn_tree_verify_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, trees: list[Tree],
    cu_seqlens: torch.Tensor, scale: float, layout: str,
) -> tuple[torch.Tensor, list[PendingGDN]]:
    """Same flattened inputs as the kernel; returns o (N, HV, V) fp32 and one PendingGDN per tree."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    outs, pendings = [], []
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        S0 = _slot_state(state, int(state_indices[n]), layout)
        sl = slice(start, end)
        o, pending = tree_gated_delta_rule(
            q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl], S0, trees[n].ancestors, scale
        )
        outs.append(o[0])
        pendings.append(pending)
    return torch.cat(outs), pendings


def gdn_tree_commit_ref(
    state: torch.Tensor, state_indices: torch.Tensor, pendings: list[PendingGDN], leaves: list[int], layout: str
) -> None:
    for slot, pending, leaf in zip(state_indices.tolist(), pendings, leaves):
        new = commit_path(_slot_state(state, slot, layout), pending, leaf)[0]
        state[slot].copy_(new if layout == "kv" else new.transpose(-1, -2))


def _slot_state(state: torch.Tensor, slot: int, layout: str) -> torch.Tensor:
    """(1, HV, K, V) view of one slot of the pool, whatever its layout."""
    S = state[slot : slot + 1]
    return S if layout == "kv" else S.transpose(-1, -2)
