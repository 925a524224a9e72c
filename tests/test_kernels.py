"""Triton kernels (weaver/kernels/) against the pure-torch references, on CPU under the Triton interpreter.

Every kernel sees random trees and the degenerate ones (single node, chain of 128, star of 128), in
batches of trees at offsets with shuffled state-pool slots, grouped value heads and both state layouts;
a wrong parent pointer must show up as a mismatch, and bad trees (cyclic, forward, outside or below -1
parent pointers, empty trees, mismatched lengths, out-of-range leaves) must be refused by both backends.
Inputs are fp32: the interpreter runs bf16 arithmetic through numpy and its results are not a reliable
reference, so bf16 is left to the GPU benchmark. The engine test runs greedy speculative decoding with
the kernels forced on. Adversarial GDN numerics: tests/test_gdn_numerics.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read by @triton.jit when the kernel modules load (lazily)

import contextlib  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from weaver.kernels.dispatch import KernelError, TreeInputError, use_triton  # noqa: E402
from weaver.kernels.gdn_tree import gdn_tree_commit_, gdn_tree_verify  # noqa: E402
from weaver.kernels.tree_attention import tree_attention  # noqa: E402
from weaver.kernels.tree_conv import conv_windows, tree_conv1d, tree_conv_commit_  # noqa: E402
from weaver.kernels.tree_mask import tree_ancestor_mask, tree_ancestor_mask_ref  # noqa: E402
from weaver.kernels.gdn_tree.reference import gdn_gates  # noqa: E402
from weaver.models.gdn import per_branch_tree_gated_delta_rule  # noqa: E402
from weaver.tree import Tree  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(atol=2e-5, rtol=2e-5)


def random_parents(T: int, gen: torch.Generator, deep: float = 0.5) -> torch.Tensor:
    """Topologically ordered parents: with probability `deep` the previous node, else uniform in [-1, i)."""
    parents = []
    for i in range(T):
        if i and float(torch.rand(1, generator=gen)) < deep:
            parents.append(i - 1)
        else:
            parents.append(int(torch.randint(-1, i, (1,), generator=gen)))
    return torch.tensor(parents)


CHAIN = torch.arange(-1, 127)
STAR = torch.full((128,), -1)
SINGLE = torch.tensor([-1])


def batch_of_trees(trees: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([0] + [len(t) for t in trees])
    return torch.cat(trees), lengths.cumsum(0)


def wrong_parent(parents: torch.Tensor) -> torch.Tensor:
    """The same tree with one parent pointer moved (node 10 of a 20-chain hangs off node 3)."""
    wrong = parents.clone()
    wrong[10] = 3
    return wrong


@pytest.fixture
def triton_on(monkeypatch):
    monkeypatch.setenv("WEAVER_KERNELS", "triton")


# ---------------------------------------------------------------- dispatch


def test_dispatch_modes(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv("WEAVER_KERNELS", raising=False)
    assert not use_triton(x)  # auto: Triton only for CUDA tensors
    monkeypatch.setenv("WEAVER_KERNELS", "torch")
    assert not use_triton(x)
    monkeypatch.setenv("WEAVER_KERNELS", "triton")
    assert use_triton(x)
    monkeypatch.setenv("WEAVER_KERNELS", "cuda")
    with pytest.raises(KernelError, match="WEAVER_KERNELS"):
        use_triton(x)


def test_the_name_kernels_is_left_to_hugging_face():
    """transformers >= 5.25 imports Hugging Face's `kernels` package at import time: from the repository root
    (first on sys.path for `python train.py`) that name must not find a folder of ours."""
    code = """
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("kernels")
assert spec is None or not pathlib.Path(spec.origin or "/").is_relative_to(pathlib.Path.cwd()), spec
import transformers.activations  # imports `kernels` when transformers finds it installed
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


# ---------------------------------------------------------------- ancestor mask


def test_ancestor_mask_matches_tree(triton_on):
    gen = torch.Generator().manual_seed(1)
    trees = [SINGLE, CHAIN, STAR] + [random_parents(int(torch.randint(2, 70, (1,), generator=gen)), gen) for _ in range(10)]
    parents, cu = batch_of_trees(trees)
    mask = tree_ancestor_mask(parents, cu)
    assert torch.equal(mask, tree_ancestor_mask_ref(parents.int(), cu.int()))


# ---------------------------------------------------------------- GDN tree verify + commit


def gdn_inputs(T: int, H: int, HV: int, K: int, V: int, slots: int, gen: torch.Generator):
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    a, b = 2 * torch.randn(1, T, HV, generator=gen), 2 * torch.randn(1, T, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV, generator=gen).log(), torch.randn(HV, generator=gen)
    pool = torch.randn(slots, HV, K, V, generator=gen)
    return q, k, v, a, b, A_log, dt_bias, pool


def check_gdn(trees, H, HV, K, V, layout, gen, wrong=None):
    """Verify + commit a batch of trees against the per-branch recurrence (one state per node).

    `wrong`: parents actually given to the kernel (the reference always uses the right ones)."""
    parents, cu = batch_of_trees(trees)
    n = len(trees)
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(len(parents), H, HV, K, V, n + 2, gen)
    slots = torch.randperm(n + 2, generator=gen)[:n]
    pool_kernel = pool.clone() if layout == "kv" else pool.transpose(-1, -2).contiguous()
    before = pool_kernel.clone()
    o, pending = gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, pool_kernel, parents if wrong is None else wrong,
                                 cu_seqlens=cu, state_indices=slots, state_layout=layout)
    assert torch.equal(pool_kernel, before), "verify must not write the committed state"
    leaves = [int(torch.randint(0, len(t), (1,), generator=gen)) for t in trees]
    gdn_tree_commit_(pool_kernel, pending, leaves)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    for i, tree in enumerate(trees):
        nodes = slice(int(cu[i]), int(cu[i + 1]))
        ref_o, ref_states = per_branch_tree_gated_delta_rule(
            q[:, nodes], k[:, nodes], v[:, nodes], g[:, nodes], beta[:, nodes], pool[slots[i]][None], tree
        )
        torch.testing.assert_close(o[:, nodes], ref_o, **TOL)
        committed = pool_kernel[slots[i]] if layout == "kv" else pool_kernel[slots[i]].transpose(-1, -2)
        torch.testing.assert_close(committed, ref_states[0, leaves[i]], **TOL)
    untouched = [s for s in range(n + 2) if s not in slots.tolist()]
    assert torch.equal(pool_kernel[untouched], before[untouched])


GDN_CASES = [  # (H, HV, K, V, layout): grouped heads, padded head dims (the tiny model's 8), both layouts
    (1, 2, 16, 16, "kv"),
    (2, 4, 32, 16, "vk"),
    (2, 2, 8, 8, "kv"),
    (1, 3, 16, 24, "vk"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", range(len(GDN_CASES)))
def test_gdn_tree_random_trees(monkeypatch, backend, case):
    monkeypatch.setenv("WEAVER_KERNELS", backend)
    gen = torch.Generator().manual_seed(10 + case)
    trees = [random_parents(int(torch.randint(1, 40, (1,), generator=gen)), gen) for _ in range(5)]
    check_gdn(trees, *GDN_CASES[case], gen)


@pytest.mark.parametrize("tree", [SINGLE, CHAIN, STAR], ids=["single", "chain128", "star128"])
def test_gdn_tree_degenerate(triton_on, tree):
    check_gdn([tree], 1, 1, 16, 16, "kv", torch.Generator().manual_seed(3))


def test_gdn_tree_shared_tree_over_batch(triton_on):
    """(B, T) inputs with one parents vector: every row is the same tree from its own slot."""
    gen = torch.Generator().manual_seed(4)
    parents = random_parents(21, gen)
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(21, 2, 4, 16, 16, 3, gen)
    rows = lambda x: torch.cat([x, x.flip(-1)])  # noqa: E731  (a second, different batch row)
    q, k, v, a, b = (rows(x) for x in (q, k, v, a, b))
    o, pending = gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, pool[:2].clone(), parents)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    ref_o, _ = per_branch_tree_gated_delta_rule(q, k, v, g, beta, pool[:2], parents)
    torch.testing.assert_close(o, ref_o, **TOL)


def test_gdn_tree_wrong_parent_is_caught(triton_on):
    with pytest.raises(AssertionError, match="not close"):
        check_gdn([torch.arange(-1, 19)], 1, 2, 16, 16, "kv", torch.Generator().manual_seed(5),
                  wrong=wrong_parent(torch.arange(-1, 19)))


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("B", [1, 2])
def test_precomputed_tree_tensors_equal_the_checked_path(monkeypatch, layout, B):
    """The torch path on a Tree's own ancestors and conv windows (what the compiled verify traces: no host
    work) gives the checked path's outputs and commits, for GDN, the tree conv and tree attention."""
    monkeypatch.setenv("WEAVER_KERNELS", "torch")
    gen = torch.Generator().manual_seed(40 + B)
    for _ in range(4):
        T = int(torch.randint(1, 30, (1,), generator=gen))
        parents = random_parents(T, gen)
        tree, leaves = Tree(torch.zeros(T, dtype=torch.long), parents), torch.randint(0, T, (B,), generator=gen)
        q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(B * T, 2, 4, 16, 8, B + 1, gen)
        q, k, v, a, b = (x.view(B, T, *x.shape[2:]) for x in (q, k, v, a, b))
        pool = pool if layout == "kv" else pool.transpose(-1, -2).contiguous()
        pools = [pool.clone(), pool.clone()]
        outs = [gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, pools[0], parents, state_layout=layout),
                gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, pools[1], tree, state_layout=layout,
                                ancestors=tree.ancestors)]
        torch.testing.assert_close(outs[1][0], outs[0][0], **TOL)
        for state, (_, pending) in zip(pools, outs):
            gdn_tree_commit_(state, pending, leaves)
        torch.testing.assert_close(pools[1], pools[0], **TOL)

        x, weight = torch.randn(B, T, 12, generator=gen), torch.randn(12, 4, generator=gen)
        conv_pool = torch.randn(B + 1, 12, 3, generator=gen)
        conv_pools = [conv_pool.clone(), conv_pool.clone()]
        convs = [tree_conv1d(x, weight, conv_pools[0], parents),
                 tree_conv1d(x, weight, conv_pools[1], tree, conv_index=conv_windows(tree, 4))]
        torch.testing.assert_close(convs[1][0], convs[0][0], **TOL)
        for state, (_, pending) in zip(conv_pools, convs):
            tree_conv_commit_(state, pending, leaves)
        torch.testing.assert_close(conv_pools[1], conv_pools[0])

        P = int(torch.randint(0, 20, (1,), generator=gen))
        qa, ka, va = torch.randn(B, 4, T, 8, generator=gen), torch.randn(B, 2, P + T, 8, generator=gen), torch.randn(B, 2, P + T, 8, generator=gen)
        valid = torch.rand(B, P, generator=gen) > 0.3
        torch.testing.assert_close(tree_attention(qa, ka, va, tree, prefix_valid=valid, ancestors=tree.ancestors),
                                   tree_attention(qa, ka, va, parents, prefix_valid=valid), **TOL)
    with pytest.raises(TreeInputError, match="ancestors has"):
        tree_attention(qa, ka, va, tree, ancestors=Tree(torch.zeros(T + 1, dtype=torch.long), random_parents(T + 1, gen)).ancestors)


# ---------------------------------------------------------------- tree conv


def brute_force_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor, node: int):
    """Plain causal conv over the node's root-to-node path, continuing the committed state (C, W-1):
    returns the node's output and the conv state a commit at that node leaves."""
    path = Tree(parents, parents).path_to(node)
    seq = torch.cat([state, x[path].T], dim=-1)
    W = weight.shape[1]
    return F.silu((seq[:, -W:] * weight).sum(-1)), seq[:, -(W - 1):]


def check_conv(trees, C, W, gen, wrong=None):
    parents, cu = batch_of_trees(trees)
    n = len(trees)
    x, weight = torch.randn(1, len(parents), C, generator=gen), torch.randn(C, W, generator=gen)
    pool = torch.randn(n + 1, C, W - 1, generator=gen)
    slots = torch.randperm(n + 1, generator=gen)[:n]
    before = pool.clone()
    out, pending = tree_conv1d(x, weight, pool, parents if wrong is None else wrong, cu_seqlens=cu, state_indices=slots)
    assert torch.equal(pool, before)
    leaves = [int(torch.randint(0, len(t), (1,), generator=gen)) for t in trees]
    tree_conv_commit_(pool, pending, leaves)
    for i, tree in enumerate(trees):
        xs = x[0, int(cu[i]) : int(cu[i + 1])]
        for node in range(len(tree)):
            ref_out, _ = brute_force_conv(xs, weight, before[slots[i]], tree, node)
            torch.testing.assert_close(out[0, int(cu[i]) + node], ref_out, **TOL)
        torch.testing.assert_close(pool[slots[i]], brute_force_conv(xs, weight, before[slots[i]], tree, leaves[i])[1])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_tree_conv_random_trees(monkeypatch, backend):
    monkeypatch.setenv("WEAVER_KERNELS", backend)
    gen = torch.Generator().manual_seed(20)
    for W in (2, 4):  # W=2: the window is the node and its parent only
        trees = [random_parents(int(torch.randint(1, 40, (1,), generator=gen)), gen) for _ in range(8)]
        check_conv(trees, 24 if W == 4 else 130, W, gen)


def test_tree_conv_degenerate(triton_on):
    check_conv([SINGLE, CHAIN, STAR], 20, 4, torch.Generator().manual_seed(21))


def test_tree_conv_wrong_parent_is_caught(triton_on):
    with pytest.raises(AssertionError, match="not close"):
        check_conv([torch.arange(-1, 19)], 8, 4, torch.Generator().manual_seed(22), wrong=wrong_parent(torch.arange(-1, 19)))


# ---------------------------------------------------------------- tree attention


def check_attention(parents, P, B, HQ, HKV, D, gen, wrong=None, with_valid=True):
    T = len(parents)
    q = torch.randn(B, HQ, T, D, generator=gen)
    k, v = torch.randn(B, HKV, P + T + 3, D, generator=gen), torch.randn(B, HKV, P + T + 3, D, generator=gen)
    k, v = k[:, :, : P + T], v[:, :, : P + T]  # a view into a larger cache, as the target passes it
    valid = torch.rand(B, P + 3, generator=gen) > 0.3 if with_valid else None
    out = tree_attention(q, k, v, parents if wrong is None else wrong, prefix_valid=valid)
    anc = Tree(parents, parents).ancestors
    prefix = torch.ones(B, T, P, dtype=torch.bool) if valid is None else valid[:, None, :P].expand(B, T, P)
    allowed = torch.cat([prefix, anc[None].expand(B, T, T)], dim=-1)[:, None]
    kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = (q @ kr.transpose(-1, -2) * D**-0.5).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ vr, **TOL)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_tree_attention_random_trees(monkeypatch, backend):
    monkeypatch.setenv("WEAVER_KERNELS", backend)
    gen = torch.Generator().manual_seed(30)
    for i in range(8):
        T, P = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(0, 50, (1,), generator=gen))
        check_attention(random_parents(T, gen), P, 1 + i % 2, 2, 1 + i % 2, 16 if i % 3 else 8, gen, with_valid=i % 4 != 0)


@pytest.mark.parametrize("tree", [SINGLE, CHAIN, STAR], ids=["single", "chain128", "star128"])
def test_tree_attention_degenerate(triton_on, tree):
    check_attention(tree, 7, 1, 1, 1, 16, torch.Generator().manual_seed(31))


def test_tree_attention_wrong_parent_is_caught(triton_on):
    with pytest.raises(AssertionError, match="not close"):
        check_attention(torch.arange(-1, 19), 5, 1, 1, 1, 16, torch.Generator().manual_seed(32),
                        wrong=wrong_parent(torch.arange(-1, 19)))


# ---------------------------------------------------------------- bad tree inputs


@contextlib.contextmanager
def no_hang(seconds: float = 20.0):
    """Turn a hang (a kernel walking a cyclic parent pointer forever) into a failure."""

    def expire(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tree_ops(parents: torch.Tensor, cu_seqlens: torch.Tensor | None = None, T: int | None = None) -> dict:
    """Every API that takes a tree, as a thunk on inputs of T nodes (default: as many as `parents`);
    tree attention only for a single tree (it takes no cu_seqlens)."""
    T = len(parents) if T is None else T
    gen = torch.Generator().manual_seed(50)
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(T, 1, 1, 16, 16, 4, gen)
    x, weight, conv_state = torch.randn(1, T, 8, generator=gen), torch.randn(8, 4, generator=gen), torch.zeros(4, 8, 3)
    ops = {
        "mask": lambda: tree_ancestor_mask(parents, cu_seqlens),
        "gdn": lambda: gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, pool, parents, cu_seqlens=cu_seqlens),
        "conv": lambda: tree_conv1d(x, weight, conv_state, parents, cu_seqlens=cu_seqlens),
    }
    if cu_seqlens is None:
        qa, ka = torch.randn(1, 1, T, 16, generator=gen), torch.randn(1, 1, 2 + T, 16, generator=gen)
        ops["attention"] = lambda: tree_attention(qa, ka, ka, parents)
    return ops


def assert_refused(ops: dict) -> None:
    for name, op in ops.items():
        with no_hang():
            try:
                op()
            except TreeInputError as refused:
                assert "invalid tree input" in str(refused), name
            else:
                pytest.fail(f"{name}: a bad tree was accepted")


BAD_PARENTS = {
    "self_cycle": [-1, 0, 1, 3, 3],  # parent[3] = 3: a walk up from node 3 never ends
    "forward_cycle": [-1, 2, 1],  # 1 -> 2 -> 1
    "forward_pointer": [-1, 2, -1],  # no cycle, but not in topological order
    "outside_tree": [-1, 0, 7],
    "below_minus_one": [-1, -2, 1],
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", BAD_PARENTS)
def test_bad_parents_are_refused(monkeypatch, backend, case):
    monkeypatch.setenv("WEAVER_KERNELS", backend)
    bad = torch.tensor(BAD_PARENTS[case])
    assert_refused(tree_ops(bad))
    assert_refused(tree_ops(*batch_of_trees([torch.arange(-1, 4), bad])))  # the bad tree second in a batch
    if case == "below_minus_one":  # the one a `Tree` itself accepts
        ops = tree_ops(Tree(torch.zeros_like(bad), bad))
        assert_refused({name: ops[name] for name in ("gdn", "conv", "attention")})


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_and_mismatched_trees_are_refused(monkeypatch, backend):
    monkeypatch.setenv("WEAVER_KERNELS", backend)
    assert_refused(tree_ops(torch.zeros(0, dtype=torch.long)))
    assert_refused(tree_ops(torch.tensor([-1, 0, 1, -1]), torch.tensor([0, 2, 2, 4])))  # tree 1 is empty
    assert_refused(tree_ops(torch.tensor([-1, 0, -1, 0]), torch.tensor([0, 2, 3])))  # offsets cover 3 of 4 nodes
    for parents in (torch.arange(-1, 4), Tree(torch.zeros(5, dtype=torch.long), torch.arange(-1, 4))):
        tree_ops(parents)["gdn"]()  # a Tree is checked once, then trusted: its length is still compared
        ops = tree_ops(parents, T=4)  # 5 parents for inputs of 4 nodes
        assert_refused({name: ops[name] for name in ("gdn", "conv", "attention")})


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_commit_leaf_out_of_range_is_refused(monkeypatch, backend):
    monkeypatch.setenv("WEAVER_KERNELS", backend)
    parents, cu = batch_of_trees([torch.arange(-1, 4), torch.tensor([-1, 0, 0])])  # 5 and 3 nodes
    gen = torch.Generator().manual_seed(51)
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(8, 1, 1, 16, 16, 2, gen)
    _, gdn_pending = gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, pool, parents, cu_seqlens=cu)
    conv_state = torch.zeros(2, 8, 3)
    _, conv_pending = tree_conv1d(torch.randn(1, 8, 8, generator=gen), torch.randn(8, 4, generator=gen), conv_state,
                                  parents, cu_seqlens=cu)
    before = pool.clone(), conv_state.clone()
    for leaves in ([0, 3], [5, 0], [-1, 0], [0]):  # leaf = T once read out of bounds, leaf = -1 did nothing
        with pytest.raises(TreeInputError, match="invalid tree input"):
            gdn_tree_commit_(pool, gdn_pending, leaves)
        with pytest.raises(TreeInputError, match="invalid tree input"):
            tree_conv_commit_(conv_state, conv_pending, leaves)
    assert torch.equal(pool, before[0]) and torch.equal(conv_state, before[1])


# ---------------------------------------------------------------- engine and benchmark


def test_greedy_speculative_decoding_with_kernels_forced_on(triton_on, tmp_path):
    """The engine's verify/commit through the Triton kernels is still lossless (tiny hybrid target)."""
    from hf_tiny import VOCAB, save_tiny_hf_model
    from weaver.engine import speculative_generate
    from weaver.generate import generate
    from weaver.models.checkpoint import load_target
    from weaver.models.drafter import Drafter
    from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config

    save_tiny_hf_model("qwen3_5_text", tmp_path)
    target = load_target(str(tmp_path))
    drafter = Drafter(drafter_config(new_drafter_config(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1,
                                                        num_taps=2))).eval()
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(40)).tolist()
    expected = generate(target, [prompt], 8)[0]
    out, stats = speculative_generate(target, drafter, prompt, 8, temperature=0, method="ddtree", budget=5)
    assert out == expected[: len(out)] and len(out) == 8
    assert len(stats.accepted) >= 2  # several verify + commit rounds went through the kernels


def test_benchmark_smoke_runs():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "benchmarks/gdn_tree_kernels.py", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(line.startswith("| 16 | 1 | fp32 |") for line in done.stdout.splitlines())


def test_the_kernels_stand_alone_without_weaver():
    """weaver/kernels/ depends on nothing else of weaver (weaver depends on it, never the reverse): every op
    imports and runs on plain tensors, and no weaver module outside weaver.kernels is loaded."""
    code = """
import sys
import torch
from weaver.kernels.gdn_tree import gdn_tree_commit_, gdn_tree_verify
from weaver.kernels.tree_attention import tree_attention
from weaver.kernels.tree_conv import tree_conv1d, tree_conv_commit_
from weaver.kernels.tree_mask import tree_ancestor_mask
parents = torch.tensor([-1, 0, 0, 1])
o, pending = gdn_tree_verify(torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 2, 8),
                             torch.randn(1, 4, 2), torch.randn(1, 4, 2), torch.zeros(2), torch.zeros(2),
                             torch.zeros(1, 2, 8, 8), parents)
gdn_tree_commit_(torch.zeros(1, 2, 8, 8), pending, 3)
out, conv = tree_conv1d(torch.randn(1, 4, 6), torch.randn(6, 4), torch.zeros(1, 6, 3), parents)
tree_conv_commit_(torch.zeros(1, 6, 3), conv, 2)
tree_attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), parents)
tree_ancestor_mask(parents.int(), torch.tensor([0, 4], dtype=torch.int32))
others = [m for m in sys.modules if m.startswith("weaver.") and not m.startswith("weaver.kernels")]
assert not others, others
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "WEAVER_KERNELS": "torch"})
    assert run.returncode == 0, run.stderr[-3000:]
