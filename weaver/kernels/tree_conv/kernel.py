"""Tree causal conv1d (depthwise, + SiLU) and its commit in Triton.

A node's window is itself and its nearest W-1 ancestors, reached by following parent pointers (W-1
gathers per node); past the root the window reads the committed conv state, newest column first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import next_pow2


@triton.jit
def _tree_conv_kernel(
    x, weight, state, state_indices, parents, cu_seqlens, out, C, stride_sn, stride_sc, stride_sw,
    W: tl.constexpr, BT: tl.constexpr, BCH: tl.constexpr,
):
    i_n, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    row_ok = rows < eos - bos
    chans = i_c * BCH + tl.arange(0, BCH)
    c_ok = chans < C
    ok = row_ok[:, None] & c_ok[None, :]
    w = tl.load(weight + chans * W + W - 1, mask=c_ok, other=0.0).to(tl.float32)
    acc = w[None, :] * tl.load(x + (bos + rows[:, None]) * C + chans[None, :], mask=ok, other=0.0).to(tl.float32)
    node = rows
    past = tl.zeros([BT], dtype=tl.int32)  # steps taken beyond the root
    for m in tl.static_range(1, W):
        node = tl.load(parents + bos + node, mask=row_ok & (node >= 0), other=-1)
        past += (node < 0).to(tl.int32)
        in_tree = tl.load(x + (bos + node[:, None]) * C + chans[None, :], mask=ok & (node[:, None] >= 0), other=0.0)
        committed = tl.load(state + slot * stride_sn + chans[None, :] * stride_sc + (W - 1 - past[:, None]) * stride_sw,
                            mask=ok & (node[:, None] < 0), other=0.0)
        w = tl.load(weight + chans * W + W - 1 - m, mask=c_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * (in_tree.to(tl.float32) + committed.to(tl.float32))
    acc = acc * tl.sigmoid(acc)
    tl.store(out + (bos + rows[:, None]) * C + chans[None, :], acc.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _tree_conv_commit_kernel(
    x, state, state_indices, parents, cu_seqlens, leaves, C, stride_sn, stride_sc, stride_sw,
    W: tl.constexpr, BW: tl.constexpr, BCH: tl.constexpr,
):
    """New conv state = the last W-1 inputs along the accepted path, gathered before any write (in place)."""
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    chans = i_c * BCH + tl.arange(0, BCH)
    c_ok = chans < C
    cols = tl.arange(0, BW)
    ptrs = state + slot * stride_sn + chans[:, None] * stride_sc + cols[None, :] * stride_sw
    old = tl.load(ptrs, mask=c_ok[:, None] & (cols[None, :] < W - 1), other=0.0)
    window = tl.zeros([BCH, BW], dtype=old.dtype)
    node = tl.load(leaves + i_n)
    past = 0
    for m in tl.static_range(0, W - 1):  # column W-2-m holds the m-th ancestor of the leaf
        if m > 0:
            if node >= 0:
                node = tl.load(parents + bos + node)
            if node < 0:
                past += 1
        if node >= 0:
            val = tl.load(x + (bos + node) * C + chans, mask=c_ok, other=0.0).to(old.dtype)
        else:
            val = tl.sum(tl.where(cols[None, :] == W - 1 - past, old, 0.0), axis=1).to(old.dtype)
        window = tl.where(cols[None, :] == W - 2 - m, val[:, None], window)
    tl.store(ptrs, window, mask=c_ok[:, None] & (cols[None, :] < W - 1))


def tree_conv1d_triton(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
    parents: torch.Tensor, cu_seqlens: torch.Tensor, T_max: int,
) -> torch.Tensor:
    """Trees checked by `weaver.kernels.dispatch.check_trees`; T_max: the largest tree's node count."""
    N, C = x.shape
    W = weight.shape[1]
    out = torch.empty_like(x)
    BT, BCH = 16, min(128, next_pow2(C))
    grid = (cu_seqlens.numel() - 1, triton.cdiv(T_max, BT), triton.cdiv(C, BCH))
    _tree_conv_kernel[grid](x, weight, state, state_indices, parents, cu_seqlens, out, C, *state.stride(),
                            W=W, BT=BT, BCH=BCH)
    return out


def tree_conv_commit_triton(
    state: torch.Tensor, x: torch.Tensor, state_indices: torch.Tensor, parents: torch.Tensor,
    cu_seqlens: torch.Tensor, leaves: torch.Tensor,
) -> None:
    C, W = x.shape[1], state.shape[-1] + 1
    BCH = min(128, next_pow2(C))
    grid = (cu_seqlens.numel() - 1, triton.cdiv(C, BCH))
    _tree_conv_commit_kernel[grid](x, state, state_indices, parents, cu_seqlens, leaves, C, *state.stride(),
                                   W=W, BW=next_pow2(W - 1, floor=2), BCH=BCH)
