"""Tree builders: best-first search against brute force, and lossless greedy decoding with every builder."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_tiny import VOCAB
from weaver.builders import chain_tree, ddtree, marginal_logprobs, marginal_tree
from weaver.engine import speculative_generate
from weaver.errors import WeaverError
from weaver.generate import generate
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config
from weaver.search import best_first_reference, best_first_tree
from weaver.tree import Tree


def paths_of(tree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[tree.path_to(i)][1:].tolist()) for i in range(1, len(tree))}


@pytest.mark.parametrize("seed,budget", [(0, 1), (1, 5), (2, 12), (3, 30)])
def test_ddtree_holds_the_best_scoring_paths(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    depth, vocab = 3, 5
    logits = 3 * torch.randn(depth, vocab, generator=gen)
    tree = ddtree(7, logits, budget).tree
    log_p = logits.log_softmax(-1)
    scored = {
        path: sum(float(log_p[d, t]) for d, t in enumerate(path))
        for n in range(1, depth + 1) for path in itertools.product(range(vocab), repeat=n)
    }
    best = sorted(scored, key=scored.get, reverse=True)[:budget]
    assert len(tree) == budget + 1 and int(tree.tokens[0]) == 7
    assert paths_of(tree) == set(best)


def draft_vocab_logits(seed: int, depth: int, vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (depth, vocab_size), vocab (size,)) as a drafter with a draft vocabulary drafts them: random logits in
    `size` random columns, the lowest finite value in every other."""
    gen = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(vocab_size, generator=gen)[:size].sort().values
    logits = torch.full((depth, vocab_size), torch.finfo(torch.float32).min)
    logits[:, vocab] = 3 * torch.randn(depth, size, generator=gen)
    return logits, vocab


@pytest.mark.parametrize("seed,budget", [(0, 1), (1, 4), (2, 9), (3, 30)])
def test_trees_read_over_the_draft_vocabulary_are_the_whole_rows_trees(seed, budget):
    """The chain and the greedy DDTree given a draft vocabulary (`Draft.vocab`) take their top-k and normalisers
    over its columns only: the trees, edge probabilities and child distributions of the whole rows."""
    logits, vocab = draft_vocab_logits(seed, 5, 50, 12)
    for build in (chain_tree, ddtree):
        fast, full = build(3, logits, budget, vocab=vocab), build(3, logits, budget)
        assert torch.equal(fast.tree.tokens, full.tree.tokens) and torch.equal(fast.tree.parents, full.tree.parents)
        assert bool(torch.isin(fast.tree.tokens[1:], vocab).all())
        torch.testing.assert_close(fast.edge_probs(), full.edge_probs())
        assert fast.child_probs.keys() == full.child_probs.keys()
        for node, probs in full.child_probs.items():
            torch.testing.assert_close(fast.child_probs[node], probs)


def test_a_sampled_chain_over_the_draft_vocabulary_draws_from_the_whole_rows_marginals():
    """Sampled, the chain's Gumbel draw runs over the draft vocabulary's columns: each depth's token follows the
    whole row's marginal (the other tokens have probability 0)."""
    logits, vocab = draft_vocab_logits(4, 2, 30, 6)
    logits[:, vocab] /= 3  # flatter, so that every token is drawn often
    gen, trials = torch.Generator().manual_seed(0), 6000
    counts = torch.zeros(2, 30)
    for _ in range(trials):
        tokens = chain_tree(3, logits, 2, gen, vocab=vocab).tree.tokens[1:]
        counts[torch.arange(2), tokens] += 1
    torch.testing.assert_close(counts / trials, logits.softmax(-1), atol=0.025, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_edge_probabilities_are_each_nodes_marginal_at_its_depth(seed):
    """DDTree's edges: node i's probability is the drafter's marginal of its token at its depth (what
    `benchmarks/tree_calibration.py` bins against acceptance); the anchor's is 1."""
    logits = 2 * torch.randn(4, 9, generator=torch.Generator().manual_seed(seed))
    proposal = ddtree(5, logits, budget=10)
    tree, probs = proposal.tree, logits.softmax(-1)
    depth = [0]
    for parent in tree.parents.tolist()[1:]:
        depth.append(depth[parent] + 1)
    want = [1.0] + [float(probs[depth[i] - 1, int(tree.tokens[i])]) for i in range(1, len(tree))]
    torch.testing.assert_close(proposal.edge_probs(), torch.tensor(want))


def node_probs_by_loop(proposal) -> list[float]:
    """The readable definition: each node's probability in its parent's child distribution (`child_probs`)."""
    probs, tree = proposal.child_probs, proposal.tree
    return [1.0] + [float(probs[p][int(tree.tokens[i])]) for i, p in enumerate(tree.parents.tolist()) if i > 0]


@pytest.mark.parametrize("kind", ["greedy weaver", "sampled weaver", "sampled ddtree", "chain"])
def test_edge_and_path_probabilities_follow_each_nodes_parent(target, kind):
    """The gathered edge probabilities equal a per-node lookup in the parent's child distribution, over
    full-vocabulary rows (DDTree, the chain) and pool supports (Weaver); a path's is their product."""
    from test_adapter import as_step, make_adapter, step_inputs
    from weaver.builders import SearchConfig, weaver_tree

    torch.manual_seed(4)
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 8, 2, 2))).eval()
    adapter = make_adapter(target)
    step = as_step(target, adapter, *step_inputs(target, drafter, [5, 9, 3, 7]))
    gen = torch.Generator().manual_seed(0)
    proposal = {
        "greedy weaver": lambda: weaver_tree(step, SearchConfig(20, 4)),
        "sampled weaver": lambda: weaver_tree(step, SearchConfig(20, 4, generator=gen)),
        "sampled ddtree": lambda: ddtree(step.anchor, step.draft.logits[0], 20, gen),
        "chain": lambda: chain_tree(step.anchor, step.draft.logits[0], 6),
    }[kind]()
    edges = proposal.edge_probs()
    torch.testing.assert_close(edges, torch.tensor(node_probs_by_loop(proposal)))
    tree = proposal.tree
    want = [float(edges[tree.path_to(i)].prod()) for i in range(len(tree))]
    torch.testing.assert_close(proposal.path_probs(), torch.tensor(want), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_the_first_nodes_of_a_tree_are_the_smaller_budgets_tree(seed):
    """`Proposal.first(b)` is the tree of budget b (nodes are best first), with only the kept nodes' expansions."""
    logits = 2 * torch.randn(5, 7, generator=torch.Generator().manual_seed(seed))
    big = ddtree(1, logits, 30)
    for b in (1, 3, 8, 29, 30):
        small, cut = ddtree(1, logits, b), big.first(b)
        assert torch.equal(cut.tree.tokens, small.tree.tokens) and torch.equal(cut.tree.parents, small.tree.parents)
        assert torch.equal(cut.tree.ancestors, Tree(cut.tree.tokens, cut.tree.parents).ancestors)
        assert all(int(nodes.max()) <= b for nodes, _, _ in cut.expansions)
        torch.testing.assert_close(cut.edge_probs(), big.edge_probs()[: b + 1])


def test_chain_tree_takes_the_argmax_per_depth():
    logits = torch.randn(6, 11)
    tree = chain_tree(3, logits, budget=4).tree
    assert tree.tokens.tolist() == [3] + logits[:4].argmax(-1).tolist()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(6))
def test_one_shot_chain_equals_the_width_one_search(seed):
    """chain_tree's one-shot per-depth choice is the best-first search with one child per node: the same
    greedy tree, and when sampling the same distribution behind every expanded node."""
    gen = torch.Generator().manual_seed(seed)
    depth, vocab = int(torch.randint(1, 16, (1,), generator=gen)), int(torch.randint(2, 50, (1,), generator=gen))
    logits, budget = 3 * torch.randn(depth, vocab, generator=gen), int(torch.randint(1, 20, (1,), generator=gen))
    temperature = [1.0, 0.7, 1.6][seed % 3]
    for sampled in (False, True):
        generator = torch.Generator().manual_seed(seed) if sampled else None
        fast = chain_tree(4, logits, budget, generator, temperature)
        search = marginal_tree(4, logits, budget, 1, generator, temperature)
        assert len(fast.tree) == len(search.tree) == 1 + min(budget, depth)
        assert fast.tree.parents.tolist() == search.tree.parents.tolist()
        assert fast.child_probs.keys() == search.child_probs.keys()
        if not sampled:  # the search keeps only the child it takes; the chain keeps the whole row
            assert fast.tree.tokens.tolist() == search.tree.tokens.tolist()
            continue
        for node, probs in search.child_probs.items():
            torch.testing.assert_close(fast.child_probs[node], probs)


@pytest.mark.parametrize("seed", range(8))
def test_one_pass_ddtree_equals_the_search(seed):
    """Greedy `ddtree` (a beam per depth, then one sort) is the best-first search's tree node for node; with
    tied scores (rounded logits) it holds paths of the same scores."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        depth, vocab = int(torch.randint(1, 8, (1,), generator=gen)), int(torch.randint(2, 30, (1,), generator=gen))
        logits, budget = 3 * torch.randn(depth, vocab, generator=gen), int(torch.randint(1, 40, (1,), generator=gen))
        tied = seed % 2 == 1
        logits = logits.round() if tied else logits
        fast, search = ddtree(5, logits, budget).tree, marginal_tree(5, logits, budget, min(budget, vocab), None, 1.0).tree
        if not tied:
            assert fast.tokens.tolist() == search.tokens.tolist() and fast.parents.tolist() == search.parents.tolist()
            continue
        log_p = logits.log_softmax(-1)
        path_scores = [sorted(round(float(log_p[torch.arange(len(p) - 1), p[1:]].sum()), 4)
                              for p in (t.tokens[t.path_to(i)] for i in range(len(t)))) for t in (fast, search)]
        assert path_scores[0] == path_scores[1]


def test_sampled_chain_draws_each_depth_from_its_marginal():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 3.0, 1.0, -2.0]])
    gen, n = torch.Generator().manual_seed(0), 6000
    drafts = torch.stack([chain_tree(0, logits, 2, gen, 0.8).tree.tokens[1:] for _ in range(n)])
    for depth in range(2):
        expected = torch.softmax(logits[depth] / 0.8, -1) * n
        counts = torch.bincount(drafts[:, depth], minlength=5).float()
        assert float(((counts - expected) ** 2 / expected).sum()) < 18.5  # chi-square, 4 dof, p = 1e-3


@pytest.mark.parametrize("method,budget", [("chain", 3), ("ddtree", 4), ("ddtree", 16), ("oracle", 8)])
def test_greedy_is_lossless_with_every_builder(target, method, budget):
    torch.manual_seed(1)
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 6, 2, 2))).eval()
    for n in (3, 11):
        prompt = torch.randint(3, VOCAB, (n,)).tolist()
        out, stats = speculative_generate(target, drafter, prompt, 32, method=method, budget=budget)
        assert out == generate(target, [prompt], 32)[0]
        if method == "oracle":  # the target's own tree always contains its greedy path
            assert min(stats.accepted) >= 1


def test_budget_zero_and_unknown_method_are_refused(target):
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 4, 2, 1))).eval()
    with pytest.raises(WeaverError, match="budget must be at least 1"):
        speculative_generate(target, drafter, [5, 6], 4, method="ddtree", budget=0)
    with pytest.raises(WeaverError, match="unknown tree method 'beam'"):
        speculative_generate(target, drafter, [5, 6], 4, method="beam", budget=3)


@pytest.mark.parametrize("method", ["ddtree", "oracle"])
def test_tree_sampling_runs_through_the_engine(target, method):
    """Tree sampling (target-only acceptance) end to end; its distribution is tested in test_tree_rules."""
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 5, 2, 1))).eval()
    runs = [speculative_generate(target, drafter, [5, 6, 7], 20, temperature=1.0, method=method, budget=6,
                                 generator=torch.Generator().manual_seed(4))[0] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20 and all(0 <= t < VOCAB for t in runs[0])


def path_dependent(seed: int, vocab: int):
    """Child log-probs that depend on the node's whole path (like the adapter's), as a token support."""
    table = (3 * torch.randn(61, vocab, generator=torch.Generator().manual_seed(seed))).log_softmax(-1)

    def child_logprobs(nodes, grown):
        rows = table[[hash(tuple(grown.path_tokens(n))) % 61 for n in nodes.tolist()]]
        return rows.topk(min(7, vocab), dim=-1)  # (log-probs, tokens) over a per-node support

    return child_logprobs


@pytest.mark.parametrize("seed", range(12))
def test_wave_search_equals_the_heap_reference(seed):
    """The tensor search and the heap written plainly build the same greedy tree: random budgets, widths,
    depths, expansion batches, full-vocabulary rows and per-node supports."""
    gen = torch.Generator().manual_seed(seed)
    vocab, depth = int(torch.randint(3, 40, (1,), generator=gen)), int(torch.randint(1, 7, (1,), generator=gen))
    budget, width = int(torch.randint(1, 60, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    per_call = int(torch.randint(1, 6, (1,), generator=gen))
    scores = marginal_logprobs(3 * torch.randn(depth, vocab, generator=gen)) if seed % 2 else path_dependent(seed, vocab)
    fast, slow = (search(5, budget, depth, scores, width, per_call, vocab_size=vocab, device="cpu")
                  for search in (best_first_tree, best_first_reference))
    assert fast.tree.tokens.tolist() == slow.tree.tokens.tolist()
    assert fast.tree.parents.tolist() == slow.tree.parents.tolist()
    assert fast.child_probs.keys() == slow.child_probs.keys()
    rebuilt = Tree(fast.tree.tokens, fast.tree.parents)  # the search's own ancestor matrix equals a fresh one
    assert torch.equal(rebuilt.ancestors, fast.tree.ancestors) and torch.equal(rebuilt.depth, fast.tree.depth)
    assert len(fast.tree) <= budget + 1 and int(fast.tree.depth.max()) < depth + 1


@pytest.mark.parametrize("search", [best_first_tree, best_first_reference], ids=["waves", "heap"])
@pytest.mark.parametrize("fixed", [1, 2])
def test_fixed_children_come_first_and_leave_the_drawn_ones_the_rest(search, fixed):
    """With `fixed` children each expanded node's first children are its most probable tokens in order, its other
    children come from the rest, and the distribution acceptance reads (`child_probs`) is the node's without the
    fixed tokens (renormalised), so a fixed child is exactly a child of draft probability 0; the first drawn child
    of the root is a plain sample from that rest."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    scores = marginal_logprobs(probs.log()[None].expand(3, -1))
    gen = torch.Generator().manual_seed(0)
    rest = probs.clone()
    rest[:fixed] = 0
    rest /= rest.sum()
    firsts = torch.zeros(5)
    for _ in range(2000):
        proposal = search(9, 12, 3, scores, 4, generator=gen, fixed=fixed, device="cpu")
        tree = proposal.tree
        for node, q in proposal.child_probs.items():
            kids = tree.tokens[tree.children(node)].tolist()
            assert kids[:fixed] == list(range(min(fixed, len(kids))))
            assert len(set(kids)) == len(kids) and all(k >= fixed for k in kids[fixed:])
            torch.testing.assert_close(q, rest)
        firsts[int(tree.tokens[tree.children(0)[fixed]])] += 1
    torch.testing.assert_close(firsts / firsts.sum(), rest, atol=0.03, rtol=0)


def test_fixed_children_of_a_sampled_chain_are_its_argmax():
    """The chain with a fixed child per depth is the greedy chain, each child of draft probability 0 to the rule."""
    logits = 3 * torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    proposal = chain_tree(2, logits, 4, torch.Generator().manual_seed(0), fixed=1)
    assert proposal.tree.tokens[1:].tolist() == logits.argmax(-1).tolist()
    for node, q in proposal.child_probs.items():
        assert float(q[int(proposal.tree.tokens[node + 1])]) == 0.0 and abs(float(q.sum()) - 1) < 1e-5


def test_sampled_wave_search_draws_children_without_replacement():
    """Gumbel-top-k: no repeated sibling, children only from the support, each first child as often as
    the distribution says (a one-node-per-depth chain: the first draw is a plain sample)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scores = marginal_logprobs(probs.log()[None].expand(3, -1))
    gen = torch.Generator().manual_seed(0)
    firsts = torch.zeros(4)
    for _ in range(4000):
        tree = best_first_tree(9, 8, 3, scores, 4, generator=gen, device="cpu").tree
        for node in range(len(tree)):
            siblings = tree.tokens[tree.children(node)].tolist()
            assert len(set(siblings)) == len(siblings)
        firsts[int(tree.tokens[tree.children(0)[0]])] += 1
    torch.testing.assert_close(firsts / firsts.sum(), probs, atol=0.025, rtol=0)
