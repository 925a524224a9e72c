"""Gated DeltaNet (GDN) recurrence in pure torch: the reference every faster path is checked against.

Head recurrence (docs/method.md §2.6), state S of shape (d_k, d_v), q and k L2-normalised:
    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t
with a_t = exp(g_t). Tensors use the fla/transformers layout: q, k (B, T, H, d_k), v (B, T, HV, d_v),
g and beta (B, T, HV), state (B, HV, d_k, d_v). HV may be a multiple of H (grouped value heads).

Unrolling the recurrence over a block of tokens whose "parent" structure is a chain gives a unit
lower-triangular system (I + X) U = beta (V - a * (K S_0)); `torch_chunk_gated_delta_rule` solves it per
chunk so prefill and training are a handful of matmuls per chunk instead of one step per token (on CUDA
`chunk_gated_delta_rule` hands the same job to fla's chunk kernel). Every solve is a forward
substitution (`solve_unit_lower`), never an explicitly formed inverse: see its docstring for the bound.
The same system on a draft tree, and the rollback-free commit, are the kernels' torch reference
(`weaver/kernels/gdn_tree/reference.py`), which this module shares its pieces with.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from weaver.kernels.dispatch import use_triton
from weaver.kernels.gdn_tree.reference import l2norm, normalized_heads, solve_unit_lower


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (decode path and reference). Returns (o (B, T, HV, d_v), final state)."""
    q, k, v = normalized_heads(q, k, v, scale)
    g, beta = g.to(v.dtype).transpose(1, 2), beta.to(v.dtype).transpose(1, 2)  # (B, HV, T)
    S = state.to(v.dtype)
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        delta = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(outs, dim=1).to(v.dtype), S


def gated_delta_step_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One decode step (T = 1), updating `state` in place; same maths as the recurrence, fewest ops."""
    B, _, H, dk = k.shape
    HV, c = v.shape[2], state.dtype  # fp32, or float64 for an exact bf16 target
    q = l2norm(q.to(c)).view(B, H, 1, 1, dk) * dk**-0.5
    k = l2norm(k.to(c)).view(B, H, 1, 1, dk)
    if HV != H:  # grouped value heads: each q/k head serves HV // H consecutive value heads
        q, k = q.expand(B, H, HV // H, 1, dk), k.expand(B, H, HV // H, 1, dk)
    q, k = q.reshape(B, HV, 1, dk), k.reshape(B, HV, 1, dk)
    state.mul_(g.to(c).view(B, HV, 1, 1).exp())
    delta = (v.to(c).view(B, HV, 1, -1) - k @ state) * beta.to(c).view(B, HV, 1, 1)
    state.add_(k.transpose(-1, -2) @ delta)
    return (q @ state).view(B, 1, HV, -1)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, chunk_size: int = 64, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill and training: fla's chunk kernel for CUDA tensors (unless WEAVER_KERNELS=torch; fla picks its
    own chunk), else `torch_chunk_gated_delta_rule`. Returns (o (B, T, HV, d_v), final state), fp32 (float64 for
    float64 inputs on the torch path)."""
    fla_chunk = _fla_chunk_kernel(v)
    if fla_chunk is None:
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size, scale)
    return call_fla_gated_delta_rule(fla_chunk, q, k, v, g, beta, state, scale)


def _fla_chunk_kernel(x: torch.Tensor) -> Callable | None:
    """fla's `chunk_gated_delta_rule` for CUDA tensors; imported only then, so CPU runs never load fla's
    Triton paths. None (torch form) on CPU, with WEAVER_KERNELS=torch, or without fla (the `gpu` extra)."""
    if not (x.is_cuda and use_triton(x)):
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        warnings.warn("flash-linear-attention is not installed: CUDA prefill runs the torch chunked form", stacklevel=3)
        return None
    return fla_chunk


def call_fla_gated_delta_rule(
    fla_fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our conventions through a function with fla's `chunk_gated_delta_rule` signature.

    Same tensor layouts on both sides: q, k (B, T, H, d_k), v (B, T, HV, d_v) with value head j reading
    q/k head j // (HV // H), g (log-decay) and beta (B, T, HV), state (B, HV, d_k, d_v) = fla's
    `initial_state` (N, HV, K, V) with `state_v_first` off. What moves: our q/k L2 norm becomes fla's
    in-kernel one, our always-returned final state becomes `output_final_state`, outputs come back fp32.
    """
    o, final = fla_fn(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    return o.float(), final.float()


def torch_chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, chunk_size: int = 64, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form of the recurrence in torch (differentiable; the CPU path and the reference).
    Returns (o (B, T, HV, d_v), final state (B, HV, d_k, d_v)), fp32 (float64 for float64 inputs: an exact bf16
    target, `weaver.models.layers.exact_math`)."""
    B, T, H, dk = k.shape
    HV, dv = v.shape[2], v.shape[3]
    q, k, v = normalized_heads(q, k, v, scale)
    g, beta = g.to(v.dtype).transpose(1, 2), beta.to(v.dtype).transpose(1, 2)
    pad = (-T) % chunk_size
    if pad:  # padded steps have k = v = 0 and g = 0: they leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n, C = (T + pad) // chunk_size, chunk_size
    q, k, v = (x.reshape(B, HV, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(B, HV, n, C), beta.reshape(B, HV, n, C)

    G = g.cumsum(-1)  # path log-decay inside each chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    X = (beta[..., None] * (k @ k.transpose(-1, -2)) * D).tril(-1)
    # (I + X) U = beta V - beta a (K S0): one solve gives a state-free part W1 and the state multiplier W2.
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)
    W1, W2 = solve_unit_lower(X, rhs).split([dv, dk], dim=-1)
    Y = (q @ k.transpose(-1, -2)) * D
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]

    S = torch.zeros(B, HV, dk, dv, dtype=q.dtype, device=q.device) if state is None else state.to(q.dtype)
    outs = []
    for i in range(n):
        U = W1[:, :, i] - W2[:, :, i] @ S
        outs.append(q_decayed[:, :, i] @ S + Y[:, :, i] @ U)
        S = S * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, HV, n * C, dv)[:, :, :T]
    return o.transpose(1, 2), S


def per_branch_tree_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for trees: each node takes one recurrence step from its parent's state (the committed
    state for children of the context). Keeps one (HV, d_k, d_v) state per node, as per-branch
    verification does today. Returns (o (B, T, HV, d_v), states (B, T, HV, d_k, d_v))."""
    T = q.shape[1]
    states, outs = [], []
    for i in range(T):
        parent_state = state if parents[i] < 0 else states[parents[i]]
        sl = slice(i, i + 1)
        o, s = recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], parent_state, scale)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), torch.stack(states, dim=1)
