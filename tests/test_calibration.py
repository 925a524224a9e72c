"""Acceptance-calibrated priorities for sampled trees (weaver.calibration): the table's estimates, the
acceptance probabilities recursive rejection sampling reports, the search's calibrated trees against the heap
reference, and losslessness with a table that keeps learning (and with a hostile one)."""

from __future__ import annotations

import pytest
import torch

from test_acceptance_rules import CHI2_CRIT_DF15, TRIALS, chi_square, first_two_tokens, synthetic_problem
from weaver.acceptance import recursive_rejection_tree
from weaver.builders import marginal_logprobs
from weaver.calibration import AcceptanceTable
from weaver.search import best_first_reference, best_first_tree
from weaver.tree import Tree


def table_from(h: dict[tuple[int, int, float], float], n: int = 400) -> AcceptanceTable:
    """A table that has seen n observations of each cell's acceptance (depth, rank, confidence) -> h."""
    table = AcceptanceTable()
    for (depth, rank, confidence), accept in h.items():
        table.observations += [(depth, rank, confidence, accept)] * n
    table.refresh()
    return table


def test_the_table_estimates_each_cells_acceptance():
    table = table_from({(1, 0, 0.9): 0.8, (1, 1, 0.9): 0.3, (1, 0, 0.15): 0.2, (2, 0, 0.9): 0.6})
    reach = table.child_log_reach(torch.tensor([1, 1, 2, 3]), torch.tensor([0.9, 0.15, 0.9, 0.9]), 2).exp()
    # rank 0 is h itself (depth 3, never seen: the mean over depths of its rank and confidence); rank 1 is
    # (1 - h_0) h_1 (depth 1, confident: 0.2 x 0.3)
    torch.testing.assert_close(reach[:, 0], torch.tensor([0.8, 0.2, 0.6, 0.7]), atol=0.01, rtol=0)
    torch.testing.assert_close(reach[0, 1], torch.tensor(0.2 * 0.3), atol=0.01, rtol=0)


@pytest.mark.parametrize("seed", range(5))
def test_priorities_fall_with_rank(seed):
    """Whatever was observed, a node's k+1-th child ranks strictly below its k-th (also past the ranks seen)."""
    gen = torch.Generator().manual_seed(seed)
    table = AcceptanceTable()
    for _ in range(300):
        depth, rank = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(0, 20, (1,), generator=gen))
        table.observations.append((depth, rank, float(torch.rand(1, generator=gen)), float(torch.rand(1, generator=gen))))
    table.refresh()
    reach = table.child_log_reach(torch.randint(1, 6, (50,), generator=gen), torch.rand(50, generator=gen), 40)
    assert (reach[:, 1:] < reach[:, :-1]).all() and (reach <= 0).all()


def test_rrs_reports_the_probability_it_accepts_with():
    """observe(node, rank, h): h at each child considered is the rule's acceptance probability there (one node, two
    drawn children: the first accepted with sum min(p, q), the second, after a rejection, with the residuals')."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(0)
    counts, reported = torch.zeros(2), {}
    trials = 20000
    for _ in range(trials):
        first, second = torch.multinomial(q, 2, generator=gen).tolist()
        tree = Tree(torch.tensor([0, first, second]), torch.tensor([-1, 0, 0]))
        seen = []
        leaf, _ = recursive_rejection_tree(tree, p.log().expand(3, -1), {0: q}, 1.0, gen,
                                           lambda node, rank, h: seen.append((rank, h)))
        reported.setdefault(0, seen[0][1])
        if leaf == 1:
            counts[0] += 1
        elif leaf == 2:
            counts[1] += 1
        if len(seen) > 1:
            reported.setdefault(("second", first), seen[1][1])
    assert reported[0] == pytest.approx(float(torch.minimum(p, q).sum()))
    # the second child's acceptance, averaged over which child came first
    second = sum(float(q[x]) * (1 - float(min(p[x], q[x]) / q[x])) * reported.get(("second", x), 0.0) for x in range(4))
    expected = torch.tensor([reported[0], second]) * trials
    assert ((counts - expected).abs() < 5 * expected.sqrt()).all(), (counts, expected)


def calibrated_scores(tree: Tree, table: AcceptanceTable, confidence: torch.Tensor) -> list[float]:
    """Each node's path score under the table, from the tree's shape (children at depth d: confidence[d - 1])."""
    scores = [0.0]
    for node in range(1, len(tree)):
        parent, depth = int(tree.parents[node]), int(tree.depth[node])
        rank = tree.children(parent).index(node)
        reach = table.child_log_reach(torch.tensor([depth]), confidence[depth - 1, None], rank + 1)[0, rank]
        scores.append(scores[parent] + float(reach))
    return sorted(scores)


@pytest.mark.parametrize("seed", range(8))
def test_calibrated_search_equals_the_heap_reference(seed):
    """With child distributions that depend on depth only, a calibrated sampled tree's priorities do not depend on
    the draws: the wave search and the heap reference take the same best `budget` of them (their shapes may
    differ only among nodes of equal score), random tables, budgets, widths and waves."""
    gen = torch.Generator().manual_seed(seed)
    vocab, depth = int(torch.randint(3, 30, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
    budget, width = int(torch.randint(1, 50, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    per_call = int(torch.randint(1, 6, (1,), generator=gen))
    table = table_from({(d, r, c): float(torch.rand(1, generator=gen)) for d in (1, 2, 3) for r in range(6)
                        for c in (0.05, 0.3, 0.6, 0.95)}, n=3)
    logits = 3 * torch.randn(depth, vocab, generator=gen)
    fast, slow = (search(5, budget, depth, marginal_logprobs(logits), width, per_call, torch.Generator().manual_seed(seed),
                         vocab, priority=table, device="cpu") for search in (best_first_tree, best_first_reference))
    assert len(fast.tree) == len(slow.tree)
    confidence = logits.softmax(-1).max(-1).values
    fast_scores, slow_scores = (calibrated_scores(p.tree, table, confidence) for p in (fast, slow))
    torch.testing.assert_close(torch.tensor(fast_scores), torch.tensor(slow_scores))
    for tree in (fast.tree, slow.tree):  # siblings are distinct draws
        assert all(len(set(tree.tokens[tree.children(n)].tolist())) == len(tree.children(n)) for n in range(len(tree)))


def calibrated_first_two_tokens(table: AcceptanceTable, learn: bool, chain: int, width: int, budget: int, trials: int):
    log_p, q = synthetic_problem(seed=1, chain=chain)

    def rule(tree, logits, child_probs, temperature, gen):
        proposal = type("P", (), {"tree": tree, "child_probs": child_probs})
        leaf, token = recursive_rejection_tree(tree, logits, child_probs, temperature, gen,
                                               table.observer(proposal) if learn else None)
        table.refresh()
        return leaf, token

    gen = torch.Generator().manual_seed(123)
    samples, accepted = first_two_tokens(rule, log_p, q, 1.0, 0, trials, gen, width, budget, priority=table)
    return chi_square(samples, log_p, 1.0, 0), accepted


def test_rrs_stays_lossless_on_calibrated_trees_while_the_table_learns():
    stat, accepted = calibrated_first_two_tokens(AcceptanceTable(), True, 2, 3, 4, TRIALS)
    assert (accepted > 0.02 * accepted.sum()).all(), accepted
    assert stat < CHI2_CRIT_DF15, f"chi2 = {stat:.1f}"


def test_rrs_stays_lossless_with_a_table_that_ranks_second_children_first():
    """A table whose raw estimates favour a node's second draw over its first (h_0 = 0.05, h_1 = 0.95): without the
    running minimum and tie-break the search would add the second draw first, or alone, and RRS would be biased."""
    hostile = table_from({(d, r, c): 0.05 if r == 0 else 0.95 for d in (1, 2, 3) for r in range(4)
                          for c in (0.05, 0.3, 0.6, 0.95)})
    stat, _ = calibrated_first_two_tokens(hostile, False, 2, 3, 4, TRIALS)
    assert stat < CHI2_CRIT_DF15, f"chi2 = {stat:.1f}"
