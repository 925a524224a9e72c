"""Tree attention in Triton (flash-attention style online softmax): every node attends to the prefix
(cache slots marked valid, or the adapter's prefix memory) and to its own ancestors-or-self among the
tree's keys, read from the shared ancestor bitmask. GQA: Hq a multiple of Hkv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import autotune_configs, next_pow2


@triton.jit
def _attend_block(q_blk, k, v, stride_kn, stride_vn, keys, key_ok, visible, m_i, l_i, acc, offs_d, D: tl.constexpr,
                  DOT: tl.constexpr):
    """One online-softmax step over the keys `keys` (scores already masked by `visible`)."""
    d_ok = offs_d[None, :] < D
    k_blk = tl.load(k + keys[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None] & d_ok, other=0.0)
    v_blk = tl.load(v + keys[:, None] * stride_vn + offs_d[None, :], mask=key_ok[:, None] & d_ok, other=0.0)
    s = tl.dot(q_blk, tl.trans(k_blk.to(tl.float32)), input_precision=DOT)
    s = tl.where(visible, s, -1.0e30)  # finite: a row with nothing visible yet must not produce NaN
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p, v_blk.to(tl.float32), input_precision=DOT)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


def _configs() -> list:
    return autotune_configs([
        triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s)
        for bm in (16, 64) for bn in (32, 64) for w in (4,) for s in (2, 3)
    ])


@triton.autotune(configs=_configs(), key=["T_BUCKET", "D", "HQ", "HKV", "DOT"])
@triton.jit
def _tree_attention_kernel(
    q, k, v, o, mask, prefix_valid, P, T, scale, T_BUCKET,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_t, spv_b,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, NW: tl.constexpr,
    HAS_VALID: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hq = i_bh // HQ, i_bh % HQ
    i_hk = i_hq // (HQ // HKV)
    rows = i_m * BM + tl.arange(0, BM)
    row_ok = rows < T
    offs_d = tl.arange(0, BD)
    q_blk = tl.load(q + i_b * sq_b + i_hq * sq_h + rows[:, None] * sq_t + offs_d[None, :],
                    mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32) * scale
    k_base, v_base = k + i_b * sk_b + i_hk * sk_h, v + i_b * sv_b + i_hk * sv_h
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for start in range(0, P, BN):  # committed prefix: every node sees the same (valid) slots
        keys = start + tl.arange(0, BN)
        key_ok = keys < P
        if HAS_VALID:
            key_ok &= tl.load(prefix_valid + i_b * spv_b + keys, mask=key_ok, other=0) != 0
        visible = row_ok[:, None] & key_ok[None, :]
        m_i, l_i, acc = _attend_block(q_blk, k_base, v_base, sk_n, sv_n, keys, keys < P, visible, m_i, l_i, acc,
                                      offs_d, D, DOT)
    for start in range(0, tl.minimum(T, (i_m + 1) * BM), BN):  # tree nodes: ancestors precede a node
        nodes = start + tl.arange(0, BN)
        node_ok = nodes < T
        words = tl.load(mask + rows[:, None] * NW + nodes[None, :] // 32,
                        mask=row_ok[:, None] & node_ok[None, :], other=0)
        visible = ((words >> (nodes[None, :] % 32)) & 1) != 0
        m_i, l_i, acc = _attend_block(q_blk, k_base, v_base, sk_n, sv_n, P + nodes, node_ok, visible, m_i, l_i, acc,
                                      offs_d, D, DOT)
    acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    tl.store(o + i_b * so_b + i_hq * so_h + rows[:, None] * so_t + offs_d[None, :], acc.to(o.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))


def tree_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, prefix_valid: torch.Tensor | None,
    scale: float, dot_precision: str,
) -> torch.Tensor:
    B, HQ, T, D = q.shape
    HKV, P = k.shape[1], k.shape[2] - T
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    valid = prefix_valid.to(torch.int8).contiguous() if prefix_valid is not None else q.new_zeros(1, 1, dtype=torch.int8)
    grid = lambda meta: (triton.cdiv(T, meta["BM"]), B * HQ)  # noqa: E731
    _tree_attention_kernel[grid](
        q, k, v, o, mask, valid, P, T, scale, next_pow2(T),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], valid.stride(0),
        HQ=HQ, HKV=HKV, D=D, BD=next_pow2(D), NW=mask.shape[1], HAS_VALID=prefix_valid is not None, DOT=dot_precision,
    )
    return o
