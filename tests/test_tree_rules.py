"""Sampling on trees: target-only acceptance reproduces the target's distribution (chi-square), and a
deliberately broken variant is caught; recursive rejection sampling stays exact when the draft
distribution depends on the whole path (as Weaver's does). Uses the synthetic first-order target of
test_acceptance_rules."""

from __future__ import annotations

import pytest
import torch

from test_acceptance_rules import CHI2_CRIT_DF15, V, chi_square, synthetic_problem
from weaver.acceptance import recursive_rejection_tree, target_only_tree
from weaver.builders import ddtree
from weaver.search import best_first_tree
from weaver.tree import Tree

TRIALS = 12000


def broken_argmax_when_off_tree(tree: Tree, target_logits: torch.Tensor, temperature: float, generator=None):
    """Wrong: when the sampled token has no child, emit the target's argmax instead of the sample."""
    leaf, token = target_only_tree(tree, target_logits, temperature, generator)
    return leaf, int(target_logits[leaf].argmax())  # the sample had no child at the leaf, by construction


def first_two(rule, log_p: torch.Tensor, q: torch.Tensor, temperature: float, budget: int, trials: int,
              gen: torch.Generator, anchor: int = 0) -> torch.Tensor:
    out = torch.empty(trials, 2, dtype=torch.long)
    for t in range(trials):
        emitted, a = [], anchor
        while len(emitted) < 2:
            tree = ddtree(a, q[a].log(), budget).tree  # deterministic tree from the proposal's marginals
            leaf, token = rule(tree, log_p[tree.tokens], temperature, gen)  # row i = log p(. | node i)
            emitted += tree.tokens[tree.path_to(leaf)][1:].tolist() + [token]
            a = emitted[-1]
        out[t] = torch.tensor(emitted[:2])
    return out


@pytest.mark.parametrize("temperature,budget", [(1.0, 5), (0.7, 3)])
def test_target_only_tree_sampling_is_lossless(temperature, budget):
    log_p, q = synthetic_problem(seed=11)
    samples = first_two(target_only_tree, log_p, q, temperature, budget, TRIALS, torch.Generator().manual_seed(2))
    assert chi_square(samples, log_p, temperature, anchor=0) < CHI2_CRIT_DF15


def test_broken_tree_rule_is_caught():
    log_p, q = synthetic_problem(seed=11)
    samples = first_two(broken_argmax_when_off_tree, log_p, q, 1.0, 3, 4000, torch.Generator().manual_seed(3))
    assert chi_square(samples, log_p, 1.0, anchor=0) > CHI2_CRIT_DF15
    assert V == 4  # the critical value above is for V * V - 1 = 15 degrees of freedom


def path_dependent_logprobs(seed: int):
    """A draft whose distribution for a node's children depends on the node's whole path (like Weaver's
    conditional), from a fixed random table indexed by a hash of the path."""
    table = torch.softmax(2.0 * torch.randn(97, V, generator=torch.Generator().manual_seed(seed)), -1).log()
    return lambda nodes, grown: table[[hash(tuple(grown.path_tokens(n))) % 97 for n in nodes.tolist()]]


@pytest.mark.parametrize("temperature,width,per_call", [(1.0, 2, 1), (0.8, 3, 2)])
def test_rejection_sampling_with_path_dependent_drafts_is_lossless(temperature, width, per_call):
    log_p, _ = synthetic_problem(seed=11)
    draft = path_dependent_logprobs(seed=5)
    gen = torch.Generator().manual_seed(9)
    out = torch.empty(TRIALS // 2, 2, dtype=torch.long)
    for t in range(len(out)):
        emitted, a = [], 0
        while len(emitted) < 2:
            proposal = best_first_tree(a, 6, 3, draft, width, per_call, generator=gen, device="cpu")
            tree = proposal.tree
            leaf, token = recursive_rejection_tree(tree, log_p[tree.tokens], proposal.child_probs, temperature, gen)
            emitted += tree.tokens[tree.path_to(leaf)][1:].tolist() + [token]
            a = emitted[-1]
        out[t] = torch.tensor(emitted[:2])
    assert chi_square(out, log_p, temperature, anchor=0) < CHI2_CRIT_DF15
