"""Acceptance rules alone (weaver.acceptance): greedy on hand-made logits, and exact statistical tests of
recursive rejection sampling and traversal verification on chains and sampled trees against a synthetic Markov
target over a tiny vocabulary.

The sampling test simulates what the engine does: draw a draft tree from a factorized proposal q_d
(`weaver.builders`, children drawn without replacement), score its nodes with the target, run the rule,
and keep the emitted tokens (accepted drafts, then the rule's token); if a step emits one token only, the
next step starts from it with a fresh tree. The first two emitted tokens must follow p(x1 | a) p(x2 | x1)
exactly (chi-square test), and the same test must reject deliberately broken rules. A chain of one draft
puts the bonus token after a fully accepted chain among the first two tokens too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weaver.acceptance import argmax, greedy_tree, recursive_rejection_tree, traversal_tree
from weaver.builders import marginal_logprobs
from weaver.search import best_first_tree
from weaver.tree import Tree

V = 4  # vocabulary of the synthetic target
CHAIN = 3  # drafts per step
TRIALS = 8000  # for the correct rule (test power); broken rules fail by orders of magnitude with fewer
BROKEN_TRIALS = 4000
# Upper 1e-3 quantile of chi-square with V*V - 1 = 15 degrees of freedom (scipy.stats.chi2.ppf(0.999, 15)).
CHI2_CRIT_DF15 = 37.697


# --- greedy -------------------------------------------------------------------------------------



def greedy_chain(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """(accepted drafts, bonus token) for the chain [anchor, d_1 .. d_{T-1}]: greedy_tree on a chain."""
    return greedy_tree(Tree.chain(torch.cat([drafts.new_zeros(1), drafts])), target_logits)

def peaked_logits(tokens: list[int], vocab: int = 11) -> torch.Tensor:
    """Row i has its argmax at tokens[i] (other entries random but lower)."""
    logits = torch.rand(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_chain_accepts_all():
    logits = peaked_logits([3, 7, 1, 9])  # target's choices after anchor, d1, d2, d3
    assert greedy_chain(logits, torch.tensor([3, 7, 1])) == (3, 9)


def test_greedy_chain_accepts_none():
    logits = peaked_logits([3, 7, 1, 9])
    assert greedy_chain(logits, torch.tensor([4, 7, 1])) == (0, 3)


@pytest.mark.parametrize("drafts,expected", [
    ([3, 2, 1], (1, 7)),
    ([3, 7, 0], (2, 1)),
    ([3, 0, 1], (1, 7)),  # a later match after a mismatch must not count
    ([5, 7, 1], (0, 3)),
])
def test_greedy_chain_partial(drafts, expected):
    logits = peaked_logits([3, 7, 1, 9])
    assert greedy_chain(logits, torch.tensor(drafts)) == expected


def test_greedy_chain_single_node():
    """A chain of the anchor alone (no drafts) emits the target's argmax."""
    assert greedy_chain(peaked_logits([6]), torch.tensor([], dtype=torch.long)) == (0, 6)


# --- sampling: broken rules the test must catch ------------------------------------------------------


def broken_rrs(tree: Tree, target_logits, child_probs, temperature, generator=None, *, residual=True,
               inverted=False, drop_rejected=True, bonus_from_parent=False):
    """recursive_rejection_tree with one deliberate mistake switched on."""
    probs = torch.softmax(target_logits.float() / temperature, dim=-1)
    node = 0
    while True:
        p, q = probs[node], child_probs.get(node)
        for child in tree.children(node):
            x = int(tree.tokens[child])
            u = float(torch.rand((), generator=generator))
            if (u * float(p[x]) <= float(q[x])) if inverted else (u * float(q[x]) <= float(p[x])):
                node = child
                break
            if residual:
                r = (p - q).clamp_min(0)
                p = r / r.sum()
            if drop_rejected:
                q = q.clone()
                q[x] = 0.0
                q = q / q.sum()
        else:
            if bonus_from_parent and not tree.children(node) and node > 0:
                p = probs[int(tree.parents[node])]
            return node, int(torch.multinomial(p, 1, generator=generator))


BROKEN = {
    "resample from p": dict(residual=False),  # on rejection, sample from p instead of max(p - q, 0)
    "inverted ratio": dict(inverted=True),  # accept with min(1, q/p)
    "keep rejected in q": dict(drop_rejected=False),  # siblings drawn without replacement, q not updated
    "bonus off by one": dict(bonus_from_parent=True),  # after a fully accepted path, draw from the parent's p
}


def broken_traversal(tree: Tree, target_logits, child_probs, temperature, generator=None, *, carry_weight=True,
                     update_weight=True, weighted_residual=True):
    """traversal_tree with one deliberate mistake switched on."""
    probs = torch.softmax(target_logits.double() / temperature, dim=-1)

    def settle(node, weight):
        p, q = probs[node], child_probs.get(node)
        for child in tree.children(node):
            x, q = int(tree.tokens[child]), q.double()
            ratio = float(p[x]) / float(q[x])
            if (found := settle(child, min(1.0, (weight if carry_weight else 1.0) * ratio))) is not None:
                return found
            residual = (weight * p - q if weighted_residual else p - q).clamp_min(0)
            rho, rejected = float(residual.sum()), float((q - torch.minimum(weight * p, q)).sum())
            p = residual / rho if rho > 0 else p
            weight = min(1.0, rho / rejected) if update_weight and rejected > 0 else weight
            q = q.clone()
            q[x] = 0.0
            q = q / q.sum()
        if node == 0 or float(torch.rand((), generator=generator)) < weight:
            return node, int(torch.multinomial(p, 1, generator=generator))
        return None

    return settle(0, 1.0)


BROKEN_TRAVERSAL = {
    "token-level weights": dict(carry_weight=False),  # a node's weight ignores its parent's: min(1, p/q)
    "weight kept after a rejection": dict(update_weight=False),  # w not replaced by rho / (rho + 1 - w)
    "unweighted residual": dict(weighted_residual=False),  # max(p - q, 0) instead of max(w p - q, 0)
}


# --- sampling: the simulation ----------------------------------------------------------------------


def synthetic_problem(seed: int, chain: int = CHAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p table (V, V): row a = log p(. | a), proposal q (V, chain, V): q_d(. | anchor a)).

    Both peaky and different from each other; p keeps every entry >= 0.05 so every chi-square cell
    has a healthy expected count.
    """
    gen = torch.Generator().manual_seed(seed)
    p = 0.8 * torch.softmax(2.5 * torch.randn(V, V, generator=gen), -1) + 0.2 / V
    q = 0.9 * torch.softmax(2.5 * torch.randn(V, chain, V, generator=gen), -1) + 0.1 / V
    return p.log(), q


def first_two_tokens(rule, log_p: torch.Tensor, q: torch.Tensor, temperature: float, anchor: int, trials: int,
                     gen: torch.Generator, width: int = 1, budget: int | None = None,
                     drawn: bool = True, priority=None, fixed: int = 0,
                     forget_fixed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(trials, 2) first two tokens emitted by repeated verify steps from `anchor`, and how often each
    accepted depth occurred (over all steps). drawn=False builds the greedy (k-best) tree instead;
    priority: the search's `AcceptanceTable` (weaver.calibration); fixed: each node's most probable children
    taken as they are (forget_fixed: the rule is handed the nodes' whole distributions instead, a broken setup)."""
    depth = q.shape[1]
    budget = budget or depth
    out = torch.empty(trials, 2, dtype=torch.long)
    accepted = torch.zeros(depth + 1, dtype=torch.long)
    for t in range(trials):
        emitted, a = [], anchor
        while len(emitted) < 2:
            proposal = best_first_tree(a, budget, depth, marginal_logprobs(q[a].log()), width,
                                       generator=gen if drawn else None, priority=priority, fixed=fixed, device="cpu")
            proposal = dataclasses.replace(proposal, fixed=0) if forget_fixed else proposal
            tree = proposal.tree
            leaf, token = rule(tree, log_p[tree.tokens], proposal.child_probs, temperature, gen)  # row i: p(. | node i)
            assert 0 <= token < V
            path = tree.path_to(leaf)
            accepted[len(path) - 1] += 1
            emitted += tree.tokens[path[1:]].tolist() + [token]
            a = emitted[-1]
        out[t] = torch.tensor(emitted[:2])
    return out, accepted


def chi_square(samples: torch.Tensor, log_p: torch.Tensor, temperature: float, anchor: int) -> float:
    """Pearson statistic of the (x1, x2) counts against p_T(x1 | a) p_T(x2 | x1), p_T = softmax(log p / T)."""
    p = torch.softmax(log_p.double() / temperature, -1)
    expected = (p[anchor][:, None] * p) * len(samples)
    counts = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).view(V, V).double()
    assert float(expected.min()) > 5
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("rule", [recursive_rejection_tree, traversal_tree], ids=["rrs", "traversal"])
@pytest.mark.parametrize("temperature,chain,anchor,width,budget", [
    (1.0, 3, 0, 1, 3),  # a chain: standard speculative sampling (traversal: block verification)
    (1.0, 1, 1, 1, 1),  # a chain of one draft: the bonus after a fully accepted chain
    (0.7, 3, 2, 2, 5),  # sampled trees: siblings drawn without replacement
    (1.0, 2, 0, 3, 6),
])
def test_sampling_rules_are_lossless(rule, temperature, chain, anchor, width, budget):
    log_p, q = synthetic_problem(seed=1, chain=chain)
    gen = torch.Generator().manual_seed(123)
    samples, accepted = first_two_tokens(rule, log_p, q, temperature, anchor, TRIALS, gen, width, budget)
    assert (accepted > 0.02 * accepted.sum()).all(), accepted  # every depth is reached, so every branch runs
    stat = chi_square(samples, log_p, temperature, anchor)
    assert stat < CHI2_CRIT_DF15, f"chi2 = {stat:.1f}"


@pytest.mark.parametrize("temperature,chain,anchor,width,budget,fixed", [
    (1.0, 3, 0, 1, 3, 1),  # a chain of fixed children: the target samples, the walk follows its token
    (0.7, 3, 2, 2, 5, 1),  # one fixed child and one drawn per node
    (1.0, 2, 0, 3, 6, 1),
    (1.0, 2, 1, 3, 6, 2),
])
def test_rejection_sampling_with_fixed_children_is_lossless(temperature, chain, anchor, width, budget, fixed):
    """Fixed children (each node's most probable, taken as they are, the rest drawn from what is left) are
    reached by the rule's residual draw: the output is still an exact sample of the target."""
    log_p, q = synthetic_problem(seed=1, chain=chain)
    gen = torch.Generator().manual_seed(321)
    samples, accepted = first_two_tokens(recursive_rejection_tree, log_p, q, temperature, anchor, TRIALS, gen, width,
                                         budget, fixed=fixed)
    assert (accepted[1:3] > 0.02 * accepted.sum()).all(), accepted  # fixed children and drawn ones are reached
    stat = chi_square(samples, log_p, temperature, anchor)
    assert stat < CHI2_CRIT_DF15, f"chi2 = {stat:.1f}"


def test_fixed_children_verified_as_drawn_ones_are_detected():
    """Handing the rule the nodes' whole distributions (fixed children tested as if drawn, drawn ones against
    the wrong q) biases the output."""
    log_p, q = synthetic_problem(seed=1, chain=2)
    gen = torch.Generator().manual_seed(5)
    samples, _ = first_two_tokens(recursive_rejection_tree, log_p, q, 1.0, 0, BROKEN_TRIALS, gen, 3, 6, fixed=1,
                                  forget_fixed=True)
    assert chi_square(samples, log_p, 1.0, 0) > CHI2_CRIT_DF15


@pytest.mark.parametrize("fixed", [1, 2])
def test_a_node_with_fixed_children_accepts_their_target_mass_on_top(fixed):
    """One node, its `fixed` most probable tokens fixed and one child drawn from the rest (q'): the rule accepts
    a draft with probability p(fixed) + sum over the rest of min(p, q'), the most any coupling of the target's
    token with that set can (docs/method.md §2.5); on this problem, a flat draft that ranks the target's favourite
    first, plain recursive rejection sampling of as many drawn children accepts less (0.80 / 0.93 against 0.91 / 1.00)."""
    p = torch.tensor([0.50, 0.10, 0.05, 0.05, 0.30])
    q = torch.tensor([0.24, 0.22, 0.20, 0.18, 0.16])
    rest = q.clone()
    rest[:fixed] = 0
    rest /= rest.sum()
    exact = float(p[:fixed].sum() + torch.minimum(p[fixed:], rest[fixed:]).sum())
    logits = p.log().expand(2 + fixed, -1)  # every node's target distribution is p (only the root's is read)
    scores = marginal_logprobs(q.log()[None])
    gen = torch.Generator().manual_seed(0)
    rates = {}
    for k in (0, fixed):
        hits = 0
        for _ in range(TRIALS):
            proposal = best_first_tree(9, fixed + 1, 1, scores, fixed + 1, generator=gen, fixed=k, device="cpu")
            leaf, _ = recursive_rejection_tree(proposal.tree, logits, proposal.child_probs, 1.0, gen)
            hits += leaf != 0
        rates[k] = hits / TRIALS
    assert abs(rates[fixed] - exact) < max(4 * (exact * (1 - exact) / TRIALS) ** 0.5, 2e-3), (rates, exact)
    assert rates[fixed] > rates[0] + 0.05, rates


@pytest.mark.parametrize("name,chain,width,budget,trials", [
    ("resample from p", 3, 1, 3, BROKEN_TRIALS), ("inverted ratio", 3, 1, 3, BROKEN_TRIALS),
    ("keep rejected in q", 2, 3, 6, TRIALS),  # the subtle one (chi2 about 55 at 4000 trials)
    ("bonus off by one", 1, 1, 1, BROKEN_TRIALS),
])
def test_broken_rules_are_detected(name, chain, width, budget, trials):
    log_p, q = synthetic_problem(seed=1, chain=chain)
    gen = torch.Generator().manual_seed(123)
    rule = lambda *args: broken_rrs(*args, **BROKEN[name])  # noqa: E731
    samples, _ = first_two_tokens(rule, log_p, q, 1.0, 1 if chain == 1 else 0, trials, gen, width, budget)
    stat = chi_square(samples, log_p, 1.0, 1 if chain == 1 else 0)
    assert stat > CHI2_CRIT_DF15, f"broken rule '{name}' passed: chi2 = {stat:.1f}"


@pytest.mark.parametrize("name,chain,width,budget", [
    ("token-level weights", 3, 1, 3), ("weight kept after a rejection", 3, 1, 3), ("unweighted residual", 3, 2, 6),
])
def test_broken_traversals_are_detected(name, chain, width, budget):
    log_p, q = synthetic_problem(seed=1, chain=chain)
    gen = torch.Generator().manual_seed(123)
    rule = lambda *args: broken_traversal(*args, **BROKEN_TRAVERSAL[name])  # noqa: E731
    samples, _ = first_two_tokens(rule, log_p, q, 1.0, 0, BROKEN_TRIALS, gen, width, budget)
    stat = chi_square(samples, log_p, 1.0, 0)
    assert stat > CHI2_CRIT_DF15, f"broken traversal '{name}' passed: chi2 = {stat:.1f}"


@pytest.mark.parametrize("chain,width,budget", [(3, 1, 3), (2, 3, 6)])
def test_traversal_accepts_more_than_recursive_rejection(chain, width, budget):
    """Sequence-level acceptance keeps paths token-level acceptance cuts (on a chain it is optimal, Sun et al.
    2024): more accepted drafts per step on the same problem, by far more than the runs' noise (~0.015)."""
    log_p, q = synthetic_problem(seed=1, chain=chain)
    mean_accepted = {}
    for rule in (recursive_rejection_tree, traversal_tree):
        _, accepted = first_two_tokens(rule, log_p, q, 1.0, 0, BROKEN_TRIALS, torch.Generator().manual_seed(7),
                                       width, budget)
        mean_accepted[rule] = float((accepted * torch.arange(len(accepted))).sum() / accepted.sum())
    assert mean_accepted[traversal_tree] > mean_accepted[recursive_rejection_tree] + 0.05, mean_accepted


def test_rejection_sampling_needs_drawn_children():
    """The same rule on the greedy (k-best) tree is biased: children must be drawn from q."""
    log_p, q = synthetic_problem(seed=1, chain=2)
    gen = torch.Generator().manual_seed(5)
    samples, _ = first_two_tokens(recursive_rejection_tree, log_p, q, 1.0, 0, BROKEN_TRIALS, gen, 3, 6, drawn=False)
    assert chi_square(samples, log_p, 1.0, 0) > CHI2_CRIT_DF15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_argmax_is_torchs_argmax_ties_included(dtype):
    """The greedy token everywhere (AR, greedy acceptance, the chain): the first maximal index, as `torch.argmax`;
    integer-valued logits tie in most rows."""
    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(-2, 3, (256, 997), generator=gen).to(dtype)
    wide = torch.randn(9, 49152, generator=gen).to(dtype)
    for logits in (ties, wide, ties[:, 5:].t(), wide[0]):
        assert torch.equal(argmax(logits), logits.argmax(-1))

