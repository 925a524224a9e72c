"""Fused GDN tree verification and commit (docs/method.md §2.6) in Triton.

One program per (V block, tree, value head). Nodes are processed in chunks of BC (topological order, so
every ancestor of a chunk's node lies in that chunk or an earlier one):
  1. path log-decay G_i = sum of g over ancestors-or-self, from the ancestor bitmask (a masked row sum);
  2. per chunk i: R_i = beta (v - a K_i S0) - sum_{j<i} X_ij U_j, then U_i = (I + X_ii)^-1 R_i by
     forward substitution over 16-row blocks inverted row by row (as fla's `solve_tril`): blocked
     forward substitution over the whole tree, stable for every BC (the bound: weaver/kernels/README.md,
     Numerics; an explicit power-series inverse would cancel catastrophically);
  3. O_i = a Q_i S0 + sum_{j<=i} Y_ij U_j.
Gates (g from A_log/a/dt_bias, beta from b) and the q/k L2 norm are computed here from the raw
projections; everything accumulates in fp32. U and G go to global memory: later chunks and the commit
read them back. The state pool is only read; the commit writes one slot in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import autotune_configs, next_pow2


@triton.jit
def _ancestor_tile(mask, bos, rows, cols, row_ok, col_ok, NW: tl.constexpr):
    """(len(rows), len(cols)) bool: node cols[j] is an ancestor-or-self of node rows[i]."""
    words = tl.load(mask + (bos + rows[:, None]) * NW + cols[None, :] // 32,
                    mask=row_ok[:, None] & col_ok[None, :], other=0)
    return ((words >> (cols[None, :] % 32)) & 1) != 0


@triton.jit
def _load_qk(ptr, bos, rows, row_ok, i_h, offs_k, H: tl.constexpr, K: tl.constexpr):
    """Rows of q or k for one head, L2-normalised in fp32 the way fla does (rsqrt(sum sq + 1e-6))."""
    x = tl.load(ptr + (bos + rows[:, None]) * H * K + i_h * K + offs_k[None, :],
                mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _log_decay(a, bos, rows, row_ok, i_hv, neg_A, dt_bias, HV: tl.constexpr):
    """g = -exp(A_log) softplus(a + dt_bias) (softplus linear above 20, as torch's), 0 on padding rows."""
    x = tl.load(a + (bos + rows) * HV + i_hv, mask=row_ok, other=0.0).to(tl.float32) + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return tl.where(row_ok, neg_A * softplus, 0.0)


@triton.jit
def _solve_diagonal_block(X, R, offs_c, BC: tl.constexpr, DOT: tl.constexpr):
    """(I + X)^-1 R for a strictly lower-triangular (BC, BC) X by blocked forward substitution with 16-row
    diagonal blocks, as fla's `solve_tril`: each block inverted row by row (Z_i = e_i - sum_{j<i} X_ij Z_j,
    from final rows only), all blocks at once; then each block subtracts the rows solved before it."""
    tl.static_assert(BC % 16 == 0)
    block = offs_c // 16
    same = block[:, None] == block[None, :]
    Xd = tl.where(same, X, 0.0)
    Z = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    for i in range(1, 16):
        row = ((offs_c % 16) == i)[:, None]  # row i of every diagonal block
        x_i = tl.sum(tl.where(row, Xd, 0.0), axis=0)  # those rows summed: their columns do not overlap
        Z = tl.where(row & same, Z - tl.sum(x_i[:, None] * Z, axis=0)[None, :], Z)
    U = tl.dot(Z, R, input_precision=DOT)
    for b in range(1, BC // 16):  # block b takes the final rows of blocks < b
        E = tl.where((block[:, None] == b) & (block[None, :] < b), X, 0.0)
        U -= tl.dot(Z, tl.dot(E, U, input_precision=DOT), input_precision=DOT)
    return U


VERIFY_CONFIGS = [  # the solve is stable for every BC: autotuning picks on speed alone
    triton.Config({"BC": bc, "BV": bv}, num_warps=w, num_stages=1) for bc in (16, 32) for bv in (32, 64) for w in (4, 8)
]


@triton.autotune(configs=autotune_configs(VERIFY_CONFIGS), key=["T_BUCKET", "K", "V", "H", "HV", "DOT"])
@triton.jit
def _gdn_tree_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, state, state_indices, mask, cu_seqlens, o, U, G, scale,
    stride_sn, stride_sh, stride_sk, stride_sv, T_BUCKET,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NW: tl.constexpr,
    BK: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)  # grouped value heads share a q/k head
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    slot = tl.load(state_indices + i_n).to(tl.int64)
    offs_c, offs_k = tl.arange(0, BC), tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    v_ok = offs_v < V
    S0 = tl.load(state + slot * stride_sn + i_hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv,
                 mask=(offs_k[:, None] < K) & v_ok[None, :], other=0.0).to(tl.float32)
    neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dtb = tl.load(dt_bias + i_hv).to(tl.float32)
    n_chunks = tl.cdiv(T, BC)

    # 1. path log-decay of every node: G_i = sum_j anc[i, j] g_j over chunks j <= i
    for ic in range(0, n_chunks):
        rows = ic * BC + offs_c
        row_ok = rows < T
        G_i = tl.zeros([BC], dtype=tl.float32)
        for jc in range(0, ic + 1):
            cols = jc * BC + offs_c
            col_ok = cols < T
            g_j = _log_decay(a, bos, cols, col_ok, i_hv, neg_A, dtb, HV)
            anc = _ancestor_tile(mask, bos, rows, cols, row_ok, col_ok, NW)
            G_i += tl.sum(tl.where(anc, g_j[None, :], 0.0), axis=1)
        tl.store(G + (bos + rows) * HV + i_hv, G_i, mask=row_ok)
    tl.debug_barrier()  # G is read back below by other threads of this program

    for ic in range(0, n_chunks):
        rows = ic * BC + offs_c
        row_ok = rows < T
        q_i = _load_qk(q, bos, rows, row_ok, i_h, offs_k, H, K) * scale
        k_i = _load_qk(k, bos, rows, row_ok, i_h, offs_k, H, K)
        v_i = tl.load(v + (bos + rows[:, None]) * HV * V + i_hv * V + offs_v[None, :],
                      mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        beta_i = tl.sigmoid(tl.load(b + (bos + rows) * HV + i_hv, mask=row_ok, other=0.0).to(tl.float32))
        beta_i = tl.where(row_ok, beta_i, 0.0)
        G_i = tl.load(G + (bos + rows) * HV + i_hv, mask=row_ok, other=0.0)
        decay_i = tl.exp(G_i)
        R = beta_i[:, None] * (v_i - decay_i[:, None] * tl.dot(k_i, S0, input_precision=DOT))
        O = decay_i[:, None] * tl.dot(q_i, S0, input_precision=DOT)
        for jc in range(0, ic):  # earlier chunks: their U is final
            cols = jc * BC + offs_c
            col_ok = cols < T
            k_j = _load_qk(k, bos, cols, col_ok, i_h, offs_k, H, K)
            G_j = tl.load(G + (bos + cols) * HV + i_hv, mask=col_ok, other=0.0)
            U_j = tl.load(U + (bos + cols[:, None]) * HV * V + i_hv * V + offs_v[None, :],
                          mask=col_ok[:, None] & v_ok[None, :], other=0.0)
            anc = _ancestor_tile(mask, bos, rows, cols, row_ok, col_ok, NW)
            D = tl.exp(tl.where(anc, G_i[:, None] - G_j[None, :], float("-inf")))
            X = beta_i[:, None] * tl.dot(k_i, tl.trans(k_j), input_precision=DOT) * D
            R -= tl.dot(X, U_j, input_precision=DOT)
            O += tl.dot(tl.dot(q_i, tl.trans(k_j), input_precision=DOT) * D, U_j, input_precision=DOT)
        # diagonal block: strict ancestors inside the chunk, solved by forward substitution
        anc = _ancestor_tile(mask, bos, rows, rows, row_ok, row_ok, NW)
        D = tl.exp(tl.where(anc, G_i[:, None] - G_i[None, :], float("-inf")))
        strict = offs_c[:, None] != offs_c[None, :]
        X = tl.where(strict, beta_i[:, None] * tl.dot(k_i, tl.trans(k_i), input_precision=DOT) * D, 0.0)
        U_i = _solve_diagonal_block(X, R, offs_c, BC, DOT)
        O += tl.dot(tl.dot(q_i, tl.trans(k_i), input_precision=DOT) * D, U_i, input_precision=DOT)
        tl.store(U + (bos + rows[:, None]) * HV * V + i_hv * V + offs_v[None, :], U_i,
                 mask=row_ok[:, None] & v_ok[None, :])
        tl.store(o + (bos + rows[:, None]) * HV * V + i_hv * V + offs_v[None, :], O,
                 mask=row_ok[:, None] & v_ok[None, :])
        tl.debug_barrier()  # U_i is read back by the next chunks


@triton.jit
def _gdn_tree_commit_kernel(
    k, U, G, state, state_indices, mask, cu_seqlens, leaves,
    stride_sn, stride_sh, stride_sk, stride_sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NW: tl.constexpr,
    BK: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
):
    """S_l = a_l S0 + sum_{j on the path} D_lj k_j u_j^T, written over the slot's state (own V block only)."""
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n)
    leaf = tl.load(leaves + i_n)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    offs_c, offs_k = tl.arange(0, BC), tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    v_ok = offs_v < V
    ptrs = state + slot * stride_sn + i_hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    s_ok = (offs_k[:, None] < K) & v_ok[None, :]
    G_l = tl.load(G + (bos + leaf) * HV + i_hv)
    S = tl.exp(G_l) * tl.load(ptrs, mask=s_ok, other=0.0).to(tl.float32)
    leaf_row = tl.zeros([1], dtype=tl.int32) + leaf
    for jc in range(0, tl.cdiv(leaf + 1, BC)):  # the path's nodes all precede the leaf
        cols = jc * BC + offs_c
        col_ok = cols <= leaf
        on_path = tl.reshape(_ancestor_tile(mask, bos, leaf_row, cols, leaf_row >= 0, col_ok, NW), [BC])
        k_j = _load_qk(k, bos, cols, col_ok, i_h, offs_k, H, K)
        G_j = tl.load(G + (bos + cols) * HV + i_hv, mask=col_ok, other=0.0)
        U_j = tl.load(U + (bos + cols[:, None]) * HV * V + i_hv * V + offs_v[None, :],
                      mask=col_ok[:, None] & v_ok[None, :], other=0.0)
        w = tl.exp(tl.where(on_path, G_l - G_j, float("-inf")))
        S += tl.dot(tl.trans(k_j * w[:, None]), U_j, input_precision=DOT)
    tl.store(ptrs, S.to(state.dtype.element_ty), mask=s_ok)


def _state_strides(state: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(slot, head, k, v) strides of a state pool in fla's (.., K, V) or SGLang's (.., V, K) layout."""
    n, h, s2, s3 = state.stride()
    return (n, h, s2, s3) if layout == "kv" else (n, h, s3, s2)


def gdn_tree_verify_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, mask: torch.Tensor,
    cu_seqlens: torch.Tensor, T_max: int, scale: float, layout: str, dot_precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flattened inputs: q, k (N, H, K), v (N, HV, V), a, b (N, HV); T_max the largest tree's node count.
    Returns o, U (N, HV, V), G (N, HV), fp32."""
    N, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    o = torch.empty(N, HV, V, dtype=torch.float32, device=v.device)
    U = torch.empty_like(o)
    G = torch.empty(N, HV, dtype=torch.float32, device=v.device)
    n_trees = cu_seqlens.numel() - 1
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), n_trees, HV)  # noqa: E731
    _gdn_tree_verify_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, state_indices, mask, cu_seqlens, o, U, G, scale,
        *_state_strides(state, layout), next_pow2(T_max),
        H=H, HV=HV, K=K, V=V, NW=mask.shape[1], BK=next_pow2(K), DOT=dot_precision,
    )
    return o, U, G


def gdn_tree_commit_triton(
    k: torch.Tensor, U: torch.Tensor, G: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
    mask: torch.Tensor, cu_seqlens: torch.Tensor, leaves: torch.Tensor, layout: str, dot_precision: str,
) -> None:
    N, H, K = k.shape
    HV, V = U.shape[1], U.shape[2]
    BV = min(64, next_pow2(V))
    grid = (triton.cdiv(V, BV), cu_seqlens.numel() - 1, HV)
    _gdn_tree_commit_kernel[grid](
        k, U, G, state, state_indices, mask, cu_seqlens, leaves, *_state_strides(state, layout),
        H=H, HV=HV, K=K, V=V, NW=mask.shape[1], BK=next_pow2(K), BC=16, BV=BV, DOT=dot_precision,
    )
