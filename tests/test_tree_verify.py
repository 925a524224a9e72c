"""Tree verification (rollback-free) against running the target on each root-to-node path alone."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import VOCAB
from weaver.kernels.dispatch import TreeInputError
from weaver.kernels.gdn_tree.reference import commit_path, gdn_gates, tree_gated_delta_rule
from weaver.models.gdn import per_branch_tree_gated_delta_rule, recurrent_gated_delta_rule
from weaver.models.target import verify_size
from weaver.tree import Tree


def random_tree(T: int, gen: torch.Generator, shape: str = "random") -> Tree:
    if shape == "chain":
        parents = torch.arange(-1, T - 1)
    elif shape == "star":
        parents = torch.full((T,), -1)
    else:
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(T)])
    return Tree(torch.randint(3, VOCAB, (T,), generator=gen), parents)


SHAPES = [(1, "random"), (6, "chain"), (6, "star"), (9, "random"), (17, "random"), (24, "random")]


@pytest.mark.parametrize("T,shape", SHAPES)
@pytest.mark.parametrize("groups", [1, 2])
def test_parallel_tree_gdn_equals_per_branch_recurrence(T, shape, groups):
    gen = torch.Generator().manual_seed(T * 7 + groups)
    tree = random_tree(T, gen, shape)
    H, HV, dk, dv = 2, 2 * groups, 8, 6
    q, k = torch.randn(1, T, H, dk, generator=gen), torch.randn(1, T, H, dk, generator=gen)
    v = torch.randn(1, T, HV, dv, generator=gen)
    g, beta = gdn_gates(torch.randn(1, T, HV, generator=gen), torch.randn(1, T, HV, generator=gen),
                        torch.randn(HV, generator=gen), torch.randn(HV, generator=gen))
    S0 = torch.randn(1, HV, dk, dv, generator=gen)
    o, pending = tree_gated_delta_rule(q, k, v, g, beta, S0, tree.ancestors)
    o_branch, states = per_branch_tree_gated_delta_rule(q, k, v, g, beta, S0, tree.parents)
    torch.testing.assert_close(o, o_branch, atol=1e-5, rtol=1e-5)
    for node in range(T):
        torch.testing.assert_close(commit_path(S0, pending, node), states[:, node], atol=1e-5, rtol=1e-5)
        path = tree.path_to(node)
        o_ref, s_ref = recurrent_gated_delta_rule(q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], S0)
        torch.testing.assert_close(o[:, node], o_ref[:, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(commit_path(S0, pending, node), s_ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("T,shape", SHAPES)
def test_tree_logits_equal_path_logits_and_commit_equals_append(target, T, shape):
    gen = torch.Generator().manual_seed(T)
    context = torch.randint(3, VOCAB, (1, 10), generator=gen)
    tree = random_tree(T, gen, shape)
    cache = target.new_cache(1, 64)
    target(context, cache)
    out, pending = target.verify(tree, cache)
    for node in range(T):
        path_tokens = tree.tokens[tree.path_to(node)]
        alone = target(torch.cat([context[0], path_tokens])[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[0, node], alone, atol=1e-4, rtol=0)

    leaf = int(torch.randint(0, T, (1,), generator=gen))
    target.commit(cache, pending, leaf)
    reference = target.new_cache(1, 64)
    target(torch.cat([context[0], tree.tokens[tree.path_to(leaf)]])[None], reference)
    assert cache.length == reference.length
    torch.testing.assert_close(cache.next_position, reference.next_position)
    for mine, theirs in zip(cache.recurrent + cache.conv, reference.recurrent + reference.conv):
        if mine is not None:
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    follow = torch.randint(3, VOCAB, (1, 3), generator=gen)
    torch.testing.assert_close(target(follow, cache).logits, target(follow, reference).logits, atol=1e-4, rtol=0)


def test_wrong_parent_pointer_is_caught():
    """A corrupted parent pointer changes what a node sees, so the path comparison must fail."""
    gen = torch.Generator().manual_seed(1)
    tree = random_tree(8, gen, "chain")
    broken = Tree(tree.tokens, torch.tensor([-1, 0, 1, 1, 3, 4, 5, 6]))  # node 3 hangs off node 1
    H, dk, dv = 1, 4, 4
    q, k, v = (torch.randn(1, 8, H, d, generator=gen) for d in (dk, dk, dv))
    g, beta = gdn_gates(torch.randn(1, 8, H), torch.randn(1, 8, H), torch.zeros(H), torch.zeros(H))
    S0 = torch.randn(1, H, dk, dv)
    o_chain, _ = tree_gated_delta_rule(q, k, v, g, beta, S0, tree.ancestors)
    o_broken, _ = tree_gated_delta_rule(q, k, v, g, beta, S0, broken.ancestors)
    assert (o_chain[:, 3:] - o_broken[:, 3:]).abs().max() > 1e-3
    torch.testing.assert_close(o_chain[:, :3], o_broken[:, :3])


@torch.no_grad()
def test_compiled_verify_equals_eager_verify(target):
    """The compiled verify pass (the tree padded to its size bucket, one graph per bucket) gives the eager
    pass's outputs for every real node and commits the same state, over random trees and context lengths."""
    gen = torch.Generator().manual_seed(5)
    taps = (0, target.cfg.num_layers - 1)
    for T, shape in [(6, "chain"), (7, "star"), (9, "random"), (14, "random"), (17, "random")]:  # buckets 9 and 17
        context = torch.randint(3, VOCAB, (1, int(torch.randint(1, 20, (1,), generator=gen))), generator=gen)
        tree, leaf = random_tree(T, gen, shape), int(torch.randint(0, T, (1,), generator=gen))
        runs = []
        for compiled in (False, True):
            cache = target.new_cache(1, 64)
            target(context, cache)
            out, pending = target.verify(tree, cache, taps, compiled=compiled)
            with pytest.raises(TreeInputError, match="leaf"):  # a padding node is no leaf to commit
                target.commit(cache, pending, T)
            target.commit(cache, pending, leaf)
            runs.append((out, cache))
        (eager, eager_cache), (fast, fast_cache) = runs
        assert fast.logits.shape == eager.logits.shape == (1, T, VOCAB)
        for mine, theirs in zip([fast.logits, fast.hidden, *fast.taps], [eager.logits, eager.hidden, *eager.taps]):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
        assert fast_cache.length == eager_cache.length
        torch.testing.assert_close(fast_cache.next_position, eager_cache.next_position)
        length = eager_cache.length
        torch.testing.assert_close(fast_cache.valid[:, :length], eager_cache.valid[:, :length])
        for mine, theirs in zip(fast_cache.keys + fast_cache.values, eager_cache.keys + eager_cache.values):
            if mine is not None:
                torch.testing.assert_close(mine[:, :, :length], theirs[:, :, :length], atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(fast_cache.recurrent + fast_cache.conv, eager_cache.recurrent + eager_cache.conv):
            if mine is not None:
                torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_padded_tree_keeps_the_real_nodes_and_hangs_padding_off_the_context():
    tree = random_tree(6, torch.Generator().manual_seed(2))
    padded = tree.padded(9)
    assert torch.equal(padded.tokens[:6], tree.tokens) and torch.equal(padded.parents[:6], tree.parents)
    assert padded.parents[6:].tolist() == [-1] * 3 and padded.depth[6:].tolist() == [0] * 3
    assert torch.equal(padded.ancestors, Tree(padded.tokens, padded.parents).ancestors)
    assert tree.padded(6) is tree
    sizes = (1, 2, 3, 4, 5, 6, 8, 9, 10, 16, 17, 18, 32, 33, 34, 65)
    assert [verify_size(n) for n in sizes] == [2, 2, 3, 4, 5, 8, 8, 9, 16, 16, 17, 32, 32, 33, 64, 65]
