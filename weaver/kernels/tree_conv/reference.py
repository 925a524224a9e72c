"""Tree causal conv1d in pure torch (the GDN mixer's short conv on a draft tree): each node's window is its
nearest W-1 ancestors then itself, falling back to the committed conv state past the root; the torch path
of `weaver.kernels.tree_conv`, applied tree by tree."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

# conv windows per tree object and kernel size: built once per verify step, read by every GDN layer
_WINDOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def conv_windows(tree, kernel: int) -> torch.Tensor:
    """(T, kernel) indices into cat(committed conv state (kernel-1 inputs), node inputs (T)) for a tree object
    with `.parents` (T,) and `.ancestors` (T, T) (weaver's `Tree`, or `weaver.kernels.dispatch.ParentTree`).

    Row i is node i's causal-conv window: its nearest kernel-1 ancestors (oldest first) then itself,
    falling back to the committed conv state past the root. Computed once per tree and kernel size."""
    built = _WINDOWS.setdefault(tree, {})
    if kernel not in built:
        parents = tree.parents
        depth = tree.ancestors.sum(-1) - 1
        T = len(parents)
        index = torch.empty(T, kernel, dtype=torch.long, device=parents.device)
        node = torch.arange(T, device=parents.device)
        index[:, kernel - 1] = kernel - 1 + node
        for m in range(1, kernel):
            node = torch.where(node >= 0, parents[node.clamp(min=0)], node)
            index[:, kernel - 1 - m] = torch.where(node >= 0, kernel - 1 + node, kernel - 1 - (m - depth))
        built[kernel] = index
    return built[kernel]


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, conv_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN mixer's depthwise causal conv + SiLU on a tree: x (B, T, C), weight (C, W), state (B, C, W-1)
    (the committed last W-1 inputs), conv_index (T, W) from `conv_windows`: each node's window is its
    nearest W-1 ancestors then itself, falling back to the committed state past the root.

    Returns the outputs (B, T, C) and the buffer cat(state, inputs) (B, C, W-1+T) that the commit reads.
    """
    buffer = torch.cat([state, x.transpose(1, 2)], dim=-1)
    out = (buffer[..., conv_index] * weight[:, None, :]).sum(-1)  # windows (B, C, T, W)
    return F.silu(out).transpose(1, 2), buffer


def tree_conv_state(buffer: torch.Tensor, conv_index: torch.Tensor, leaf: int) -> torch.Tensor:
    """Committed conv state after the path ending at `leaf`: the path's last W-1 inputs (B, C, W-1)."""
    return buffer[..., conv_index[leaf, 1:]]


def tree_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, trees: list,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """x (N, C) flattened trees; tree n continues the conv state in slot state_indices[n]."""
    outs = []
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        slot = int(state_indices[n])
        conv_index = conv_windows(trees[n], weight.shape[1])
        outs.append(tree_causal_conv1d(x[None, start:end], weight, state[slot : slot + 1], conv_index)[0][0])
    return torch.cat(outs)


def tree_conv_commit_ref(
    state: torch.Tensor, x: torch.Tensor, state_indices: torch.Tensor, trees: list, cu_seqlens: torch.Tensor,
    leaves: list[int],
) -> None:
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        slot = int(state_indices[n])
        buffer = torch.cat([state[slot], x[start:end].T], dim=-1)
        state[slot].copy_(tree_conv_state(buffer, conv_windows(trees[n], state.shape[-1] + 1), leaves[n]))
