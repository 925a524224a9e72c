"""GDN numerics on adversarial inputs: every solve path against a float64 recurrence.

Real checkpoints do not have random keys: after the short conv and SiLU they are strongly correlated,
beta is often near 1 and many heads barely decay. The recurrence stays bounded there (each step is a
contraction), but an explicitly formed inverse of the unit lower-triangular system is a sum of terms
as large as 2^depth that cancel. Here: identical, near-identical and correlated keys, beta -> 1, g -> 0,
chains up to 256 nodes and a deep narrow tree, through the torch tree path, the Triton tree kernel in
every autotune config (interpreter) and chunked prefill (T = 512, several chunks), each within `TOL` of
an independent float64 per-branch recurrence; fla's naive forms are a second reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read by @triton.jit when the kernel modules load (lazily)

import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from weaver.kernels.gdn_tree import gdn_tree_commit_, gdn_tree_verify  # noqa: E402
from weaver.kernels.gdn_tree.kernel import VERIFY_CONFIGS, _gdn_tree_verify_kernel  # noqa: E402
from weaver.kernels.gdn_tree.reference import gdn_gates  # noqa: E402
from weaver.models.gdn import call_fla_gated_delta_rule, chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402


def load_fla_naive():
    """fla's pure-torch GDN forms (`fla/ops/gated_delta_rule/naive.py`, torch and einops only), loaded from
    fla-core's files: conftest hides the `fla` package, whose import pulls in its Triton paths."""
    path = importlib.metadata.distribution("fla-core").locate_file("fla/ops/gated_delta_rule/naive.py")
    spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLA_NAIVE = load_fla_naive()
# Max abs error against float64, outputs and committed states (both O(1) to O(10) here). The stable solves
# reach <= 3e-6 on every case; the power-series inverses they replace missed by 3e-4 (Triton, BC = 16) to
# inf/nan; 1e-3 is the bar.
TOL = 1e-4
# Every autotune candidate of the verify kernel that computes differently in the interpreter: the chunk
# BC and the V block BV (warps and stages do not exist there).
INTERPRETED_CONFIGS = list({(c.kwargs["BC"], c.kwargs["BV"]): c for c in VERIFY_CONFIGS}.values())


def fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrence64(q, k, v, g, beta, S0, parents: list[int], scale: float):
    """Float64 per-branch recurrence, written out apart from weaver.models.gdn: node i takes one step from
    its parent's state (S0 for -1). q, k (T, H, K) raw; v (T, HV, V); g, beta (T, HV); S0 (HV, K, V).
    Returns o (T, HV, V) and every node's state (T, HV, K, V)."""
    groups = v.shape[1] // k.shape[1]
    q, k = (fla_l2norm(x.double()).repeat_interleave(groups, 1) for x in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    states, outs = [], []
    for i, p in enumerate(parents):
        S = (S0.double() if p < 0 else states[p]) * g[i].exp()[:, None, None]
        u = beta[i, :, None] * (v[i] - torch.einsum("hkv,hk->hv", S, k[i]))
        S = S + k[i][:, :, None] * u[:, None, :]
        states.append(S)
        outs.append(scale * torch.einsum("hkv,hk->hv", S, q[i]))
    return torch.stack(outs), torch.stack(states)


def narrow_tree(depth: int, branches: int) -> list[int]:
    """`branches` chains of `depth` nodes, each hanging off the middle of the previous one (deep, narrow)."""
    parents = []
    for n in range(branches):
        start = len(parents)
        parents += [start - depth // 2 if n else -1] + list(range(start, start + depth - 1))
    return parents


def chain(T: int) -> list[int]:
    return list(range(-1, T - 1))


# keys: shared direction + noise * randn (mean cosine ~ 1 / (1 + noise^2)); beta = sigmoid(logit); g = -decay
KEYS = {"identical": 0.0, "near_identical": 0.1, "correlated": 1.0}
CASES = {  # name: (parents, keys, beta logit, decay)
    "identical_beta1_nodecay_chain256": (chain(256), "identical", 20.0, 0.0),
    "identical_beta1_chain64": (chain(64), "identical", 20.0, 1e-3),
    "near_identical_deep_tree": (narrow_tree(80, 3), "near_identical", 5.0, 1e-4),
    "correlated_beta_half_chain96": (chain(96), "correlated", 0.0, 0.05),
}
H, HV, K, V = 1, 2, 16, 40  # grouped value heads; V = 40 splits over two V blocks of 32


def adversarial_inputs(T: int, keys: str, beta_logit: float, decay: float, gen: torch.Generator):
    """Raw projections as `gdn_tree_verify` takes them, (1, T, ...), and the state (1, HV, K, V)."""
    k = torch.randn(1, 1, H, K, generator=gen) + KEYS[keys] * torch.randn(1, T, H, K, generator=gen)
    q, v = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, HV, V, generator=gen)
    a, b = torch.zeros(1, T, HV), torch.full((1, T, HV), beta_logit)
    A_log = torch.full((HV,), decay / torch.log(torch.tensor(2.0))).log()  # g = -exp(A_log) softplus(0) = -decay
    return q, k, v, a, b, A_log, torch.zeros(HV), torch.randn(1, HV, K, V, generator=gen)


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


def check_tree_case(name: str, scale: float | None = None) -> None:
    parents, keys, beta_logit, decay = CASES[name]
    q, k, v, a, b, A_log, dt_bias, S0 = adversarial_inputs(len(parents), keys, beta_logit, decay,
                                                           torch.Generator().manual_seed(len(name)))
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    ref_o, ref_states = recurrence64(q[0], k[0], v[0], g[0], beta[0], S0[0], parents, scale or K**-0.5)
    pool = S0.clone()
    o, pending = gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor(parents), scale=scale)
    leaf = len(parents) - 1  # the deepest node of the last branch
    gdn_tree_commit_(pool, pending, leaf)
    assert max_error(o[0], ref_o) < TOL, f"outputs off by {max_error(o[0], ref_o):.1e}"
    assert max_error(pool[0], ref_states[leaf]) < TOL, f"state off by {max_error(pool[0], ref_states[leaf]):.1e}"


@pytest.mark.parametrize("name", CASES)
def test_tree_verify_torch_backend_adversarial(monkeypatch, name):
    monkeypatch.setenv("WEAVER_KERNELS", "torch")
    check_tree_case(name)


@pytest.mark.parametrize("config", INTERPRETED_CONFIGS, ids=lambda c: f"BC{c.kwargs['BC']}-BV{c.kwargs['BV']}")
@pytest.mark.parametrize("name", [name for name in CASES if name != "identical_beta1_nodecay_chain256"])
def test_tree_verify_triton_every_config_adversarial(monkeypatch, name, config):
    monkeypatch.setenv("WEAVER_KERNELS", "triton")
    monkeypatch.setattr(_gdn_tree_verify_kernel, "configs", [config])  # a single candidate: no tuning
    check_tree_case(name)


def test_tree_verify_triton_chain256(monkeypatch):
    """The longest chain once (seconds per config in the interpreter), in the config with the largest
    diagonal blocks, where an explicit inverse cancels most."""
    monkeypatch.setenv("WEAVER_KERNELS", "triton")
    largest = max(INTERPRETED_CONFIGS, key=lambda c: c.kwargs["BC"])
    monkeypatch.setattr(_gdn_tree_verify_kernel, "configs", [largest])
    check_tree_case("identical_beta1_nodecay_chain256")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tree_verify_honours_scale(monkeypatch, backend):
    """A scale other than 1/sqrt(K) reaches the outputs on both backends (the torch path once lost it)."""
    monkeypatch.setenv("WEAVER_KERNELS", backend)
    check_tree_case("correlated_beta_half_chain96", scale=1.0)


# ---------------------------------------------------------------- chunked prefill and fla's references


def chain_inputs(keys: str, beta_logit: float, decay: float, T: int = 512):
    q, k, v, a, b, A_log, dt_bias, S0 = adversarial_inputs(T, keys, beta_logit, decay, torch.Generator().manual_seed(7))
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    ref_o, ref_states = recurrence64(q[0], k[0], v[0], g[0], beta[0], S0[0], chain(T), K**-0.5)
    return (q, k, v, g, beta, S0), ref_o, ref_states[-1]


CHUNK_CASES = {  # (keys, beta logit, decay)
    "identical_beta1_nodecay": ("identical", 20.0, 0.0),
    "near_identical_beta1": ("near_identical", 5.0, 1e-4),
    "correlated_beta_half": ("correlated", 0.0, 0.05),
}


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunked_prefill_adversarial(case, chunk_size):
    inputs, ref_o, ref_state = chain_inputs(*CHUNK_CASES[case])
    o, state = chunk_gated_delta_rule(*inputs, chunk_size=chunk_size)  # CPU tensors: the torch chunked form
    assert max_error(o[0], ref_o) < TOL and max_error(state[0], ref_state) < TOL


def fla_contract(naive):
    """fla's naive form under the chunk kernel's contract, which the naive forms leave to the caller:
    q and k L2-normalised in the kernel, grouped value heads (HV a multiple of H)."""

    def call(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        assert use_qk_l2norm_in_kernel
        groups = v.shape[2] // q.shape[2]
        q, k = (fla_l2norm(x.float()).repeat_interleave(groups, 2) for x in (q, k))
        return naive(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state)

    return call


@pytest.mark.parametrize("naive", ["naive_chunk_gated_delta_rule", "naive_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("case", ["random", "near_identical_beta1"])
def test_fla_naive_through_our_layout_conversion(naive, case):
    """The conversion the CUDA prefill path applies before fla's chunk kernel (`call_fla_gated_delta_rule`),
    fed to fla's naive forms: the outputs and final state (B, HV, K, V) of our recurrence, and within TOL
    of the float64 one."""
    gen = torch.Generator().manual_seed(11)
    T, scale = 150, 0.3
    if case == "random":
        shapes = ((T, H, K), (T, H, K), (T, HV, V), (T, HV), (T, HV), (HV,), (HV,), (HV, K, V))
        q, k, v, a, b, A_log, dt_bias, S0 = (torch.randn(2, *shape, generator=gen) for shape in shapes)
        A_log, dt_bias = A_log[0], dt_bias[0]
    else:
        q, k, v, a, b, A_log, dt_bias, S0 = adversarial_inputs(T, "near_identical", 5.0, 1e-4, gen)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, state = call_fla_gated_delta_rule(fla_contract(getattr(FLA_NAIVE, naive)), q, k, v, g, beta, S0, scale)
    ours_o, ours_state = recurrent_gated_delta_rule(q, k, v, g, beta, S0, scale=scale)
    torch.testing.assert_close(o, ours_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state, ours_state, atol=2e-5, rtol=2e-5)
    ref_o, ref_states = recurrence64(q[0], k[0], v[0], g[0], beta[0], S0[0], chain(T), scale)
    assert max_error(o[0], ref_o) < TOL and max_error(state[0], ref_states[-1]) < TOL
