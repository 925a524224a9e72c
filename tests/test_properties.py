"""Property-based tests (hypothesis) of the invariants every speculative step relies on:

- acceptance rules (weaver.acceptance) accept a root-to-node path of any tree; greedy accepts exactly the
  longest path that follows the target's argmax chain;
- tree builders (weaver.builders, weaver.search) never exceed the budget and build well-formed trees
  (parents first, depth = parent depth + 1, no two siblings with the same token);
- verify + commit leaves the target cache, and the committed taps the drafter context, equal to a fresh
  prefill of the committed tokens (tests/cache_checks.py states the tolerance), with a negative control.

Example counts are set per test (`max_examples`); tests taking the `target` fixture run them once per
target (hybrid GDN and dense attention).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cache_checks import ATOL, assert_cache_matches, assert_context_matches, cache_drift, context_drift, prefill, \
    verify_and_commit
from hf_tiny import VOCAB
from test_adapter import BLOCK, as_step, make_adapter, step_inputs
from test_engine import random_drafter
from weaver.acceptance import greedy_tree, recursive_rejection_tree, target_only_tree, traversal_tree
from weaver.builders import SearchConfig, StepInputs, chain_tree, ddtree, max_tree_nodes, oracle_tree, weaver_tree
from weaver.models.drafter import Draft, Drafter
from weaver.search import Proposal
from weaver.tree import Tree, ancestor_matrix

SEEDS = st.integers(0, 2**32 - 1)
TEMPERATURES = st.sampled_from([0.5, 1.0, 2.0])
POOL = 4  # the adapter's candidates per depth: small, so that width x depth caps some budgets


# --- strategies -------------------------------------------------------------------------------------------


@st.composite
def trees(draw, vocab: int, max_nodes: int = 24, prefer: list[int] | None = None) -> Tree:
    """A tree rooted at node 0, each node's parent an earlier node, siblings holding distinct tokens (as every
    builder makes them). prefer: a token per node that its children take when hypothesis says so (to grow
    paths along a target's argmax)."""
    n = draw(st.integers(1, max_nodes if prefer is None else min(max_nodes, len(prefer))))
    parents, tokens, taken = [-1], [draw(st.integers(0, vocab - 1))], [set()]
    for node in range(1, n):
        parent = draw(st.sampled_from([j for j in range(node) if len(taken[j]) < vocab]))
        free = sorted(set(range(vocab)) - taken[parent])
        preferred = prefer is not None and prefer[parent] in free and draw(st.booleans())
        token = prefer[parent] if preferred else draw(st.sampled_from(free))
        parents.append(parent)
        tokens.append(token)
        taken[parent].add(token)
        taken.append(set())
    return Tree(torch.tensor(tokens), torch.tensor(parents))


@st.composite
def scored_trees(draw, max_nodes: int = 24) -> tuple[Tree, torch.Tensor]:
    """(tree, target logits (T, V)): random logits, the tree often following their argmax."""
    vocab, scale = draw(st.integers(2, 9)), draw(st.sampled_from([0.3, 1.0, 4.0]))
    logits = scale * torch.randn(max_nodes, vocab, generator=torch.Generator().manual_seed(draw(SEEDS)))
    tree = draw(trees(vocab, max_nodes, prefer=logits.argmax(-1).tolist()))
    return tree, logits[: len(tree)]


@st.composite
def draft_logits(draw) -> torch.Tensor:
    """A drafter block's logits (depth, vocab): random sizes and peakedness."""
    depth, vocab, scale = draw(st.integers(1, 6)), draw(st.integers(2, 30)), draw(st.sampled_from([0.1, 1.0, 4.0]))
    return scale * torch.randn(depth, vocab, generator=torch.Generator().manual_seed(draw(SEEDS)))


@st.composite
def commit_runs(draw, max_steps: int = 5) -> tuple[list[int], list[tuple[Tree, int]]]:
    """(prompt, steps): each step a tree over the target's vocabulary and the leaf its acceptance stops at."""
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        tree = draw(trees(VOCAB, max_nodes=16))
        steps.append((tree, draw(st.integers(0, len(tree) - 1))))
    return prompt, steps


def generator_or_none(sampled: bool, seed: int) -> torch.Generator | None:
    return torch.Generator().manual_seed(seed) if sampled else None


# --- acceptance rules --------------------------------------------------------------------------------------


def assert_root_path(tree: Tree, leaf: int) -> list[int]:
    """tree.path_to(leaf) starts at the root, ends at leaf, and each node's parent is the node before it."""
    path, parents = tree.path_to(leaf).tolist(), tree.parents.tolist()
    assert path[0] == 0 and path[-1] == leaf, path
    assert all(parents[child] == parent for parent, child in zip(path, path[1:])), (path, parents)
    return path


def on_argmax_chain(tree: Tree, logits: torch.Tensor) -> list[int]:
    """Nodes whose every ancestor-to-child step takes the parent's argmax token (walking the parent array)."""
    choice, parents, tokens = logits.argmax(-1).tolist(), tree.parents.tolist(), tree.tokens.tolist()

    def follows(node: int) -> bool:
        return node == 0 or (tokens[node] == choice[parents[node]] and follows(parents[node]))

    return [node for node in range(len(tree)) if follows(node)]


@given(problem=scored_trees())
@settings(max_examples=500, deadline=None)
def test_greedy_accepts_the_longest_argmax_path(problem):
    """greedy_tree accepts a root path made of exactly the nodes on the argmax chain (the longest such path,
    unique when siblings differ), and its bonus is the argmax after the leaf."""
    tree, logits = problem
    leaf, bonus = greedy_tree(tree, logits)
    assert assert_root_path(tree, leaf) == on_argmax_chain(tree, logits)
    assert bonus == int(logits[leaf].argmax()) and tree.child(leaf, bonus) is None


@given(problem=scored_trees(), rule=st.sampled_from(["rrs", "traversal", "target_only"]), temperature=TEMPERATURES,
       seed=SEEDS)
@settings(max_examples=500, deadline=None)
def test_sampling_rules_accept_a_root_path(problem, rule, temperature, seed):
    """recursive_rejection_tree, traversal_tree and target_only_tree stop at a node on a root path and emit a token
    in the vocabulary that none of that node's children holds (a held token would have moved on to that child)."""
    tree, logits = problem
    gen = torch.Generator().manual_seed(seed)
    if rule in ("rrs", "traversal"):
        q = torch.randn(len(tree), logits.shape[-1], generator=gen).softmax(-1)
        accept = recursive_rejection_tree if rule == "rrs" else traversal_tree
        leaf, token = accept(tree, logits, dict(enumerate(q)), temperature, gen)
    else:
        leaf, token = target_only_tree(tree, logits, temperature, gen)
    assert_root_path(tree, leaf)
    assert 0 <= token < logits.shape[-1] and tree.child(leaf, token) is None


# --- tree builders -----------------------------------------------------------------------------------------


def depths_from_parents(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for parent in parents:  # -1: a child of the committed context
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return depth


def assert_well_formed(proposal: Proposal, budget: int, max_depth: int, vocab: int, capacity: int | None) -> None:
    """At most `budget` draft nodes (exactly min(budget, capacity) when capacity is given), parents before
    children, depth = parent depth + 1 <= max_depth, distinct sibling tokens, each drawn from its parent's
    published distribution (child_probs > 0), and the search's ancestor matrix equal to a fresh one."""
    tree = proposal.tree
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    assert 1 <= len(tree) <= budget + 1
    if capacity is not None:
        assert len(tree) - 1 == min(budget, capacity)
    assert parents[0] == -1 and all(0 <= parent < node for node, parent in enumerate(parents) if node)
    depth = depths_from_parents(parents)
    assert tree.depth.tolist() == depth and max(depth) <= max_depth
    assert torch.equal(tree.ancestors, Tree(tree.tokens, tree.parents).ancestors)
    assert all(0 <= token < vocab for token in tokens[1:])
    for node in range(len(tree)):
        siblings = [tokens[child] for child in tree.children(node)]
        assert len(set(siblings)) == len(siblings), f"node {node} has repeated children {siblings}"
        assert all(float(proposal.child_probs[node][token]) > 0 for token in siblings)


@st.composite
def parent_lists(draw) -> list[int]:
    """Parents of a random tree in topological order: node i hangs off an earlier node or the context (-1)."""
    raw = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=40))
    return [-1] + [r % (i + 1) - 1 for i, r in enumerate(raw[1:], start=1)]


@given(parents=parent_lists())
@settings(max_examples=300, deadline=None)
def test_ancestor_matrix_in_fixed_passes_equals_walking_up(parents):
    """`ancestor_matrix` with the depth bound (tensor ops only, what a compiled search traces) and without it
    (passes until every chain ends) against walking each node's parents in Python."""
    expected = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        up = node
        while up >= 0:
            expected[node, up] = True
            up = parents[up]
    depth = max(depths_from_parents(parents))
    p = torch.tensor(parents)
    assert torch.equal(ancestor_matrix(p), expected) and torch.equal(ancestor_matrix(p, depth), expected)
    if depth:  # one pass too few misses the deepest node's farthest ancestor
        assert not torch.equal(ancestor_matrix(p, depth - 1), expected)


@given(logits=draft_logits(), budget=st.integers(1, 40), method=st.sampled_from(["chain", "ddtree"]),
       sampled=st.booleans(), temperature=TEMPERATURES, anchor=st.integers(0, 29), seed=SEEDS)
@settings(max_examples=500, deadline=None)
def test_marginal_builders_make_well_formed_trees(logits, budget, method, sampled, temperature, anchor, seed):
    """chain_tree and ddtree, greedy and sampled: well-formed trees within the budget, a chain one child per
    node; greedy trees fill the budget up to what depth x vocabulary can hold."""
    depth, vocab = logits.shape
    build = chain_tree if method == "chain" else ddtree
    proposal = build(anchor, logits, budget, generator_or_none(sampled, seed), temperature)
    capacity = depth if method == "chain" else max_tree_nodes(depth, vocab)
    assert_well_formed(proposal, budget, depth, vocab, None if sampled else capacity)
    assert int(proposal.tree.tokens[0]) == anchor
    if method == "chain":
        assert all(len(proposal.tree.children(node)) <= 1 for node in range(len(proposal.tree)))


@pytest.fixture(scope="module")
def drafter(target) -> Drafter:
    return random_drafter(target, BLOCK)


@pytest.fixture(scope="module")
def adapter(target):
    torch.manual_seed(5)
    return make_adapter(target, pool_size=POOL)


PROMPTS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)


@given(prompt=PROMPTS, budget=st.integers(1, 30), width=st.integers(1, POOL), per_call=st.integers(1, 6),
       sampled=st.booleans(), temperature=TEMPERATURES, seed=SEEDS, rescore=st.sampled_from([None, None, 1, 2, 4]))
@settings(max_examples=80, deadline=None)
@torch.inference_mode()
def test_weaver_builder_makes_well_formed_trees(target, drafter, adapter, prompt, budget, width, per_call, sampled,
                                                temperature, seed, rescore):
    """weaver_tree over a random drafter's block and a random adapter: well-formed trees within the budget;
    greedy wave-search ones hold min(budget, trees of depth D with `width` children per node) (a rescored
    tree holds the candidates among the adapter's `width` best, fewer when the drafter's are not)."""
    logits, hidden, target_hidden, anchor = step_inputs(target, drafter, prompt)
    proposal = weaver_tree(as_step(target, adapter, logits, hidden, target_hidden, anchor),
                           SearchConfig(budget, width, per_call, generator_or_none(sampled, seed), temperature,
                                        rescore=rescore))
    depth = len(logits)
    full = not sampled and rescore is None
    assert_well_formed(proposal, budget, depth, VOCAB, max_tree_nodes(depth, width) if full else None)


@given(prompt=PROMPTS, budget=st.integers(1, 16), max_depth=st.integers(1, 5), per_call=st.integers(1, 4),
       sampled=st.booleans(), temperature=TEMPERATURES, seed=SEEDS)
@settings(max_examples=50, deadline=None)
@torch.inference_mode()
def test_oracle_builder_makes_well_formed_trees_and_leaves_the_cache(target, prompt, budget, max_depth, per_call,
                                                                     sampled, temperature, seed):
    """oracle_tree: well-formed trees within the budget (greedy: exactly the budget), and its verify calls
    leave the committed cache bit for bit as it was."""
    cache = target.new_cache(1, len(prompt) + budget + 1)
    target(torch.tensor([prompt]), cache, logits_to_keep=0)
    before = copy.deepcopy(cache)
    blank = Draft(torch.zeros(1, max_depth, VOCAB), torch.zeros(1, max_depth, target.cfg.hidden_size))  # depth only
    proposal = oracle_tree(StepInputs(prompt[-1], blank, torch.zeros(target.cfg.hidden_size), target, cache),
                           SearchConfig(budget, nodes_per_call=per_call, generator=generator_or_none(sampled, seed),
                                        temperature=temperature))
    capacity = max_tree_nodes(max_depth, VOCAB)
    assert_well_formed(proposal, budget, max_depth, VOCAB, None if sampled else capacity)
    assert assert_cache_matches(cache, before) == 0.0


# --- verify + commit against a fresh prefill ---------------------------------------------------------------


@torch.inference_mode()
def run_steps(target, drafter: Drafter, prompt: list[int], steps: list[tuple[Tree, int]]):
    """(target cache, drafter context, committed tokens) after prefilling `prompt` and committing each step."""
    max_len = len(prompt) + sum(len(tree) for tree, _ in steps)
    cache, context = prefill(target, drafter, prompt, max_len)
    committed = list(prompt)
    for tree, leaf in steps:
        committed += verify_and_commit(target, drafter, cache, context, tree, leaf)
    return cache, context, committed


@given(run=commit_runs())
@settings(max_examples=150, deadline=None)
def test_commit_equals_a_fresh_prefill(target, drafter, run):
    """After several verify + commit steps over random trees and accepted leaves, the target cache (KV over
    used slots, GDN state, conv window, length, next_position, valid) and the drafter context equal a fresh
    prefill of prompt + every committed path."""
    prompt, steps = run
    cache, context, committed = run_steps(target, drafter, prompt, steps)
    reference, reference_context = prefill(target, drafter, committed, cache.max_len)
    assert_cache_matches(cache, reference)
    assert_context_matches(context, reference_context)


@given(run=commit_runs(max_steps=3), other=st.integers(0, 15))
@settings(max_examples=40, deadline=None)
def test_a_prefill_of_another_leaf_fails_the_check(target, drafter, run, other):
    """Control: prefilling the tokens of another leaf of the last tree than the one committed (a different
    token path) makes the cache or the context check fail."""
    prompt, steps = run
    tree, leaf = steps[-1]
    other %= len(tree)
    tokens = tree.tokens[tree.path_to(other)].tolist()
    assume(tokens != tree.tokens[tree.path_to(leaf)].tolist())
    cache, context, committed = run_steps(target, drafter, prompt, steps)
    wrong = committed[: len(committed) - len(tree.path_to(leaf))] + tokens
    reference, reference_context = prefill(target, drafter, wrong, cache.max_len)
    with pytest.raises(AssertionError):
        assert_cache_matches(cache, reference)
    with pytest.raises(AssertionError):
        assert_context_matches(context, reference_context)


def test_another_leaf_of_the_same_depth_moves_every_tensor_past_the_tolerance(target, drafter):
    """Control at equal lengths: committing leaf 3 but prefilling leaf 4's path (same depth, other tokens)
    moves every KV, GDN state, conv window and drafter context tensor by more than 10x the tolerance, while a
    prefill of leaf 3's own path passes."""
    prompt = [5, 9, 3, 7, 11]
    tree = Tree(torch.tensor([11, 20, 30, 40, 50]), torch.tensor([-1, 0, 0, 1, 2]))
    cache, context, committed = run_steps(target, drafter, prompt, [(tree, 3)])
    assert committed == prompt + [11, 20, 40]
    reference, reference_context = prefill(target, drafter, prompt + [11, 30, 50], cache.max_len)
    drift = cache_drift(cache, reference) | context_drift(context, reference_context)
    assert min(drift.values()) > 10 * ATOL, drift
    right, right_context = prefill(target, drafter, committed, cache.max_len)
    assert_cache_matches(cache, right)
    assert_context_matches(context, right_context)
