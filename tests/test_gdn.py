"""Fast GDN paths (chunked prefill, in-place decode step) against the token-by-token recurrence."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from weaver.kernels.gdn_tree.reference import gdn_gates, solve_unit_lower
from weaver.models.gdn import chunk_gated_delta_rule, gated_delta_step_, recurrent_gated_delta_rule, torch_chunk_gated_delta_rule


def random_inputs(B: int, T: int, H: int, HV: int, dk: int, dv: int, gen: torch.Generator):
    q, k = torch.randn(B, T, H, dk, generator=gen), torch.randn(B, T, H, dk, generator=gen)
    v = torch.randn(B, T, HV, dv, generator=gen)
    g, beta = gdn_gates(
        torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen),
        torch.randn(HV, generator=gen), torch.randn(HV, generator=gen),
    )
    return q, k, v, g, beta, torch.randn(B, HV, dk, dv, generator=gen)


@pytest.mark.parametrize("trial", range(12))
def test_chunked_equals_recurrent(trial):
    gen = torch.Generator().manual_seed(trial)
    H = int(torch.randint(1, 3, (1,), generator=gen))
    HV = H * int(torch.randint(1, 3, (1,), generator=gen))
    T = int(torch.randint(1, 150, (1,), generator=gen))
    chunk, scale = [16, 32, 64][trial % 3], [None, 0.5][trial % 2]
    q, k, v, g, beta, S0 = random_inputs(2, T, H, HV, 8, 12, gen)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, S0, scale)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, S0, chunk_size=chunk, scale=scale)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


def test_cpu_prefill_never_reaches_fla(monkeypatch):
    """CPU tensors take the torch chunked form even with kernels forced on; fla is never imported."""
    monkeypatch.setenv("WEAVER_KERNELS", "triton")
    monkeypatch.setitem(sys.modules, "fla", None)  # any import of fla fails (and would warn)
    q, k, v, g, beta, S0 = random_inputs(1, 20, 1, 2, 8, 4, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, S0)
    o_ref, s_ref = torch_chunk_gated_delta_rule(q, k, v, g, beta, S0)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("groups", [1, 3])
def test_decode_step_equals_recurrent(groups):
    gen = torch.Generator().manual_seed(groups)
    q, k, v, g, beta, S0 = random_inputs(3, 5, 2, 2 * groups, 8, 4, gen)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, S0)
    state = S0.clone()
    outs = [gated_delta_step_(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], state) for t in range(5)]
    torch.testing.assert_close(torch.cat(outs, dim=1), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 64, 100])
def test_solve_unit_lower(n):
    X = (0.3 * torch.randn(4, n, n, dtype=torch.float64)).tril(-1)
    R = torch.randn(4, n, 5, dtype=torch.float64)
    torch.testing.assert_close(solve_unit_lower(X, R), torch.linalg.solve(torch.eye(n, dtype=torch.float64) + X, R))


def test_solve_unit_lower_is_differentiable():
    X = (0.3 * torch.randn(2, 20, 20, dtype=torch.float64)).tril(-1).requires_grad_()
    R = torch.randn(2, 20, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda X, R: solve_unit_lower(X.tril(-1), R), (X, R))
