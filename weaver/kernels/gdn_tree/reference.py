"""GDN tree verification in pure torch: the maths every backend is checked against (docs/method.md §2.6),
and the torch path of `weaver.kernels.gdn_tree`, applied tree by tree.

Head recurrence, state S of shape (d_k, d_v), q and k L2-normalised:
    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t
with a_t = exp(g_t). Layouts as in fla: q, k (B, T, H, d_k), v (B, T, HV, d_v), g and beta (B, T, HV), state
(B, HV, d_k, d_v); HV a multiple of H (grouped value heads). On a tree each node continues its own
root-to-node path; the parallel form solves one unit lower-triangular system per tree, and the commit
is one rank-|path| update of the untouched committed state (no per-node snapshots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise the last dim the way fla does (rsqrt of sum of squares plus eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What the GDN maths runs in: float64 for float64 inputs (a bf16 target made exact on a CPU computes between
    its matmuls in float64), else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b), in fp32 (float64 for
    float64 inputs)."""
    c = compute_dtype(a)
    g = -A_log.to(c).exp() * F.softplus(a.to(c) + dt_bias.to(c))
    return g, b.to(c).sigmoid()


def normalized_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise q/k, then scale q (default 1/sqrt(d_k)); expand grouped heads to HV; layout (B, HV, T, d), fp32
    (float64 for float64 inputs)."""
    groups, c = v.shape[2] // k.shape[2], compute_dtype(v)
    q = l2norm(q.to(c)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    k = l2norm(k.to(c))
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.to(c).transpose(1, 2)


def solve_unit_lower(X: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """U with (I + X) U = R, for strictly lower-triangular X (..., n, n) and R (..., n, m); differentiable.

    Forward substitution (BLAS trsm), never the explicit inverse. In every GDN system
    |X_ij| = beta_i |k_i . k_j| D_ij <= 1, and |((I + X)^-1)_ij| <= 1 too: column j is the recurrence's
    response to a unit write at node j, which the contractions a (I - beta k k^T) cannot grow. Substitution
    solves (I + X + dX) U = R with |dX| <= c n u |I + X| (u = unit roundoff), so its error is at most
    c n u |(I + X)^-1| |I + X| |U| <= c n^3 u max|U|; the power series (I - X)(I + X^2)(I + X^4)... sums
    terms up to 2^(n-2) that cancel (correlated keys, beta ~ 1, no decay: fp32 loses every digit by n ~ 30).
    """
    return torch.linalg.solve_triangular(X, R, upper=False, unitriangular=True)  # the zero diagonal is not read


@dataclass
class PendingGDN:
    """What a verify pass leaves for the commit: the committed state is never written during verify."""

    k: torch.Tensor  # (B, HV, T, d_k), normalised keys
    U: torch.Tensor  # (B, HV, T, d_v), solved write vectors u_j
    G: torch.Tensor  # (B, HV, T), path log-decay G_j (sum of g over ancestors-or-self)
    ancestors: torch.Tensor  # (T, T) bool, ancestors[i, j]: j is an ancestor of i or i itself


def tree_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, ancestors: torch.Tensor, scale: float | None = None,
) -> tuple[torch.Tensor, PendingGDN]:
    """Outputs of T nodes in topological order, each continuing its own root-to-node path (docs/method.md §2.6).

    Parallel form: G_i = sum of g over ancestors-or-self, D_ij = exp(G_i - G_j) on ancestors-or-self,
    (I + X) U = beta (V - a K S0) with X_ij = beta_i (k_i . k_j) D_ij on strict ancestors,
    O = a (Q S0) + Y U with Y_ij = (q_i . k_j) D_ij. A chain is the tree whose ancestors are the causal mask.
    q is scaled by `scale` (default 1/sqrt(d_k)) after its L2 norm.
    """
    q, k, v = normalized_heads(q, k, v, scale)  # (B, HV, T, d)
    g, beta = g.to(q.dtype).transpose(1, 2), beta.to(q.dtype).transpose(1, 2)  # (B, HV, T)
    S0 = state.to(q.dtype)
    A = ancestors.to(q.dtype)
    G = g @ A.T
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~ancestors, float("-inf")).exp()
    strict = ancestors & ~torch.eye(len(ancestors), dtype=torch.bool, device=q.device)
    X = (beta[..., None] * (k @ k.transpose(-1, -2)) * D) * strict
    a = G.exp()[..., None]
    U = solve_unit_lower(X, beta[..., None] * (v - a * (k @ S0)))
    o = a * (q @ S0) + ((q @ k.transpose(-1, -2)) * D) @ U
    return o.transpose(1, 2), PendingGDN(k, U, G, ancestors)


def commit_path(state: torch.Tensor, pending: PendingGDN, leaf: int) -> torch.Tensor:
    """State after the accepted root-to-`leaf` path: S_l = a_l S0 + sum_{j on path} D_lj k_j u_j^T.

    One rank-|path| update of the untouched committed state: no replay, no per-node snapshots.
    """
    G_leaf = pending.G[..., leaf : leaf + 1]  # (B, HV, 1)
    weights = torch.where(pending.ancestors[leaf], (G_leaf - pending.G).exp(), 0.0)  # (B, HV, T)
    return state.to(pending.U.dtype) * G_leaf[..., None].exp() + (pending.k * weights[..., None]).transpose(-1, -2) @ pending.U


def gdn_tree_verify_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, trees: list,
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
