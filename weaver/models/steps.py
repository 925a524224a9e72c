"""What one forward call of the target tells its layers (`Step`), and what it hands back: the outputs, and
for a verified tree what the commit of an accepted path needs (`Pending`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weaver.kernels.gdn_tree import GDNTreePending
from weaver.kernels.tree_conv import TreeConvPending
from weaver.tree import Tree


@dataclass
class Step:
    """What every layer needs to know about the tokens of one forward call."""

    positions: torch.Tensor  # (B, T) position ids (RoPE)
    cos: torch.Tensor  # (B, T, 1, rotary_dim)
    sin: torch.Tensor
    start: int  # first cache slot the new tokens occupy (0 without a cache)
    attn_mask: torch.Tensor | None = None  # (B, 1, T, start + T) bool, or None when `is_causal`/unmasked suffices
    is_causal: bool = False  # a prefill of unpadded tokens on an empty cache
    token_mask: torch.Tensor | None = None  # (B, T) 1 for real tokens, 0 for left padding; None when no padding
    tree: Tree | None = None  # verification: the new tokens form this tree and nothing is committed
    ancestors: torch.Tensor | None = None  # the tree's (T, T) ancestors-or-self and (T, kernel) conv windows,
    conv_index: torch.Tensor | None = None  # built once per verify and shared by every layer
    pending: dict[int, GDNLayerPending] = field(default_factory=dict)  # per GDN layer, what `commit` needs


@dataclass
class GDNLayerPending:
    """What one GDN layer's verify leaves for its commit (its committed states are untouched until then)."""

    state: GDNTreePending
    conv: TreeConvPending


@dataclass
class Pending:
    """A verified tree not yet committed: accepted nodes are committed by `TargetModel.commit`."""

    tree: Tree
    start: int  # cache slot of node 0
    layers: dict[int, GDNLayerPending]


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # (B, T_kept, V)
    hidden: torch.Tensor  # final-norm hidden states (B, T, H)
    taps: list[torch.Tensor] = field(default_factory=list)  # outputs of the requested decoder layers
