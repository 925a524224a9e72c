"""`budget: auto`: the counterfactual acceptance it learns from, its choice, and lossless decoding with it."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import VOCAB
from weaver.acceptance import greedy_tree
from weaver.budget import BudgetPlanner, StepwisePlanner, measure_step_costs
from weaver.builders import chain_tree, ddtree
from weaver.engine import speculative_generate
from weaver.errors import WeaverError
from weaver.generate import generate
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config


@pytest.mark.parametrize("seed", range(8))
def test_a_smaller_budget_accepts_the_prefix_of_nodes_within_it(seed):
    """What the planner assumes: the budget-b tree is the first b nodes of a larger one, so greedy acceptance
    on it keeps exactly the accepted path's nodes with index <= b."""
    gen = torch.Generator().manual_seed(seed)
    draft = 2 * torch.randn(6, 5, generator=gen)
    target = 2 * torch.randn(64, 5, generator=gen)  # target logits per tree node (any fixed table will do)
    big = ddtree(0, draft, 40).tree
    leaf, _ = greedy_tree(big, target[: len(big)])
    path = big.path_to(leaf)[1:].tolist()
    for b in range(1, 41):
        small = ddtree(0, draft, b).tree
        assert torch.equal(small.tokens, big.tokens[: b + 1])
        small_leaf, _ = greedy_tree(small, target[: len(small)])
        assert len(small.path_to(small_leaf)) - 1 == sum(1 for n in path if n <= b)


@torch.inference_mode()
def test_anytime_weaver_trees_are_prefixes_of_larger_ones(target):
    """With the size-driven expansion schedule `budget: auto` uses, batched adapter calls keep the prefix
    property: the tree of budget b is the first b nodes of the tree of budget 40."""
    from test_adapter import as_step, make_adapter, step_inputs
    from weaver.builders import SearchConfig, weaver_tree

    torch.manual_seed(3)
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 8, 2, 2))).eval()
    adapter = make_adapter(target)
    step = as_step(target, adapter, *step_inputs(target, drafter, [5, 9, 3, 7]))
    big = weaver_tree(step, SearchConfig(40, 4, anytime=True)).tree
    for b in (1, 5, 16, 17, 23, 33):
        small = weaver_tree(step, SearchConfig(b, 4, anytime=True)).tree
        assert torch.equal(small.tokens, big.tokens[: b + 1]) and torch.equal(small.parents, big.parents[: b + 1])


def test_the_planner_picks_the_best_tokens_per_second():
    planner = BudgetPlanner({2: 1.0, 8: 1.4, 32: 4.0}, explore_every=4)
    assert planner.next_budget() == 32  # the first step explores the largest candidate
    planner.observe(32, [1, 3, 9, 20])  # nodes within budget 2: one; within 8: two; within 32: four
    assert planner.accepted == {2: 1, 8: 2, 32: 4}
    assert planner.best() == 8  # tokens per second: 2 / 1.0, 3 / 1.4, 5 / 4.0
    for _ in range(40):
        planner.observe(8, [1, 2, 5, 7])  # budget 2 would keep two, budget 8 four: 8 still wins
    accepted = planner.accepted
    assert accepted[2] == pytest.approx(2, abs=0.05) and accepted[8] == pytest.approx(4, abs=0.05)
    assert accepted[32] == pytest.approx(accepted[8] + 2)  # the gain 8 -> 32 seen once stays
    assert planner.best() == 8


def test_exploration_backs_off_while_the_choice_holds_and_restarts_when_it_moves():
    planner = BudgetPlanner({2: 1.0, 8: 1.4, 32: 4.0}, explore_every=4)
    planner.next_budget()  # the largest, first
    planner.observe(32, [1, 3, 9, 20])  # best: 8
    explored = []
    for step in range(2, 200):
        if planner.next_budget() == 32:
            explored.append(step)
            planner.observe(32, [1, 3, 9, 20])  # the gain 8 -> 32 seen once more: the choice holds
    # 4 steps after the choice moved to 8, at that rate until the gain above it rests on 4 steps, then 8, 16, 32, 64, 64
    assert explored == [6, 10, 14, 18, 26, 42, 74, 138]
    unmeasured = BudgetPlanner({2: 1.0, 8: 1.4, 32: 4.0}, explore_every=4)
    unmeasured.next_budget()
    unmeasured.observe(32, [1, 3, 9, 20])
    assert [step for step in range(2, 40) if unmeasured.next_budget() == 32] == list(range(6, 40, 4))  # no new steps at 32
    for _ in range(40):
        planner.observe(8, [1])  # nodes beyond budget 2 stop being accepted: 2 wins
    assert planner.best() == 2
    budgets = [planner.next_budget() for _ in range(5)]
    assert budgets == [2, 2, 2, 2, 8]  # the new choice is explored above 4 steps after it was made


def test_exploration_reaches_past_a_plateau():
    """The first step accepted nothing, so every gain starts at zero and the planner picks budget 1; the
    drafts that pay sit between budgets 2 and 4, a gain the next larger candidate (2) never shows. Exploring
    as far as a step costing 1.75 times the choice's (here budget 8) finds them, and the choice moves to 4."""
    planner = BudgetPlanner({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 2.5}, explore_every=4)
    assert planner.next_budget() == 16
    planner.observe(16, [])
    explored = []
    for step in range(2, 60):
        budget = planner.next_budget()
        if budget != planner.choice:
            explored.append(budget)
        planner.observe(budget, [1, 3, 4])  # within 1 and 2: one; within 4 and above: three
    assert explored[0] == 8 and planner.best() == 4  # (1 + 3) / 1.1 beats (1 + 1) / 1.0
    assert planner.accepted[4] == pytest.approx(3, abs=0.1)  # a plain mean of the readings: 0 once, then 3


def test_a_gain_read_after_a_long_gap_outweighs_its_stale_estimate():
    """The gain 1 -> 4 read as zero for 20 steps, then not at all for 30 (the choice sat at 1): the next
    reading (2) weighs as the 30 steps of decay say (1 - 0.9 ** 31), not as one step's 0.1."""
    planner = BudgetPlanner({1: 1.0, 4: 1.2}, explore_every=4, decay=0.9)
    for _ in range(20):
        planner.next_budget()
        planner.observe(4, [1])
    for _ in range(30):
        planner.next_budget()
        planner.observe(1, [1])
    planner.next_budget()
    planner.observe(4, [1, 2, 3])
    assert planner.accepted[4] - planner.accepted[1] == pytest.approx(2 * (1 - 0.9 ** 31))


def test_exploration_stays_within_its_reach():
    planner = BudgetPlanner({1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, explore_every=2, explore_reach=2.0)
    assert planner._explored_from(1) == 2 and planner._explored_from(2) == 4  # 1.5 <= 2.0; 2.5 <= 3.0 < 4.0
    assert BudgetPlanner({1: 1.0, 4: 3.0}, explore_reach=2.0)._explored_from(1) == 4  # beyond reach: the next one
    assert planner._explored_from(8) == 8
    assert BudgetPlanner({1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, explore_reach=4.0)._explored_from(1) == 8


def test_rarely_seen_budgets_borrow_the_frequent_level():
    """A larger budget seen only on exploration steps moves with the smaller one's fresh estimate."""
    planner = BudgetPlanner({4: 1.0, 16: 1.5}, explore_every=8)
    planner.observe(16, [1, 2, 3, 4, 9, 12])  # 4 within budget 4, 6 within 16
    for _ in range(30):
        planner.observe(4, [])  # the drafter went bad: nothing accepted
    assert planner.accepted[4] < 0.2 and planner.accepted[16] == pytest.approx(planner.accepted[4] + 2)


def test_measured_steps_correct_a_misjudged_cost():
    """A start-up probe that made budget 16 look cheap: the steps taken at 16 reveal its real cost."""
    planner = BudgetPlanner({4: 1.0, 16: 1.1}, explore_every=8)
    planner.observe(16, [1, 2, 3, 4, 9], seconds=3.0)  # 4 accepted within 4, 5 within 16
    assert planner.best() == 4  # one measured step moved the cost half way: (1 + 5) / 2.05 < (1 + 4) / 1.0
    for _ in range(30):
        planner.observe(16, [1, 2, 3, 4, 9], seconds=3.0)
    assert planner.costs[16] == pytest.approx(3.0, rel=0.1) and planner.costs[4] == 1.0


def test_planner_settings_are_checked():
    with pytest.raises(WeaverError, match="candidate budgets"):
        BudgetPlanner({0: 1.0})
    with pytest.raises(WeaverError, match="explore_every"):
        BudgetPlanner({4: 1.0}, explore_every=1)
    with pytest.raises(WeaverError, match="explore_reach"):
        BudgetPlanner({4: 1.0}, explore_reach=0.5)
    for decay in (1.0, -0.1, "0.9"):
        with pytest.raises(WeaverError, match="decay"):
            BudgetPlanner({4: 1.0}, decay=decay)


def test_step_costs_are_interleaved_medians():
    calls = []
    costs = measure_step_costs(lambda b: calls.append(b) or [b / 10, b / 5], [4, 1], repeats=2)
    assert calls == [4, 1, 4, 1] and costs == {4: pytest.approx(0.6), 1: pytest.approx(0.15)}


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_greedy_with_auto_budget_equals_autoregressive(target, method):
    torch.manual_seed(2)
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 8, 2, 2))).eval()
    planner = BudgetPlanner({1: 1.0, 3: 1.2, 7: 2.0}, explore_every=3)
    for n in (3, 9):
        prompt = torch.randint(3, VOCAB, (n,)).tolist()
        out, stats = speculative_generate(target, drafter, prompt, 40, method=method, budget=planner)
        assert out == generate(target, [prompt], 40)[0]
        assert set(stats.budgets) <= {1, 3, 7} and len(stats.budgets) == len(stats.accepted)


def confident_chain(probs: list[float]):
    """A chain proposal whose argmax at depth d (token 0) has probability probs[d], the rest spread over 9 others."""
    p = torch.tensor(probs)[:, None]
    return chain_tree(5, torch.cat([p, ((1 - p) / 9).expand(-1, 9)], -1).log(), len(probs))


@pytest.mark.parametrize("seed", range(6))
def test_a_stepwise_budget_maximises_the_trees_expected_tokens_per_second(seed):
    """The cut is the candidate with the most (1 + sum of the first b nodes' path probabilities) / cost(b),
    by brute force over random trees and costs; the verified tree is the first b nodes."""
    gen = torch.Generator().manual_seed(seed)
    proposal = ddtree(0, 3 * torch.randn(6, 5, generator=gen), 40)
    costs = dict(zip([1, 2, 4, 8, 16, 32], (1 + torch.rand(6, generator=gen).cumsum(0)).tolist()))
    cut = StepwisePlanner(costs).cut(proposal)
    edges, tree = proposal.edge_probs(), proposal.tree
    reach = [float(edges[tree.path_to(i)].prod()) for i in range(1, len(tree))]
    best = max(costs, key=lambda b: (1 + sum(reach[:b])) / costs[b])
    assert len(cut.tree) == best + 1 and torch.equal(cut.tree.tokens, tree.tokens[: best + 1])


def test_a_confident_step_verifies_a_long_chain_and_an_unsure_one_a_short_one():
    planner = StepwisePlanner({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5})
    assert planner.next_budget() == 8  # every step builds the largest candidate's tree
    assert len(planner.cut(confident_chain([0.99] * 4 + [0.3] * 4)).tree) == 5
    assert len(planner.cut(confident_chain([0.99] * 8)).tree) == 9
    assert len(planner.cut(confident_chain([0.15] * 8)).tree) == 2
    # the path's product, not each edge alone: edges of 0.5 reach 0.5, 0.25, 0.125, ... (1.94 expected tokens
    # at 4 for 1.2, 2.0 at 8 for 1.5); counted edge by edge, budget 8 would look best (5 / 1.5)
    assert len(planner.cut(confident_chain([0.5] * 8)).tree) == 5
    # the start-up probe's planner: one candidate, the tree built at a larger budget and cut to it
    probe = StepwisePlanner({2: 1.0}, build=8)
    assert probe.next_budget() == 8 and len(probe.cut(confident_chain([0.99] * 8)).tree) == 3
    # a tree smaller than the smallest candidate is verified whole
    assert StepwisePlanner({4: 1.0, 8: 1.5}).cut(confident_chain([0.9] * 2)).tree.tokens.numel() == 3


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_greedy_with_stepwise_budgets_equals_autoregressive(target, method):
    torch.manual_seed(2)
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 8, 2, 2))).eval()
    planner = StepwisePlanner({1: 1.0, 3: 1.05, 7: 1.1})
    for n in (3, 9):
        prompt = torch.randint(3, VOCAB, (n,)).tolist()
        out, stats = speculative_generate(target, drafter, prompt, 40, method=method, budget=planner)
        assert out == generate(target, [prompt], 40)[0]
        assert set(stats.budgets) <= {1, 3, 7} and len(stats.budgets) == len(stats.accepted)


@pytest.mark.parametrize("method,temperature,stepwise,planner", [
    ("ddtree", 0.0, True, StepwisePlanner), ("chain", 0.0, True, StepwisePlanner),
    ("weaver", 0.0, True, BudgetPlanner),  # its search calls the adapter per wave: a large tree is not cheap
    ("ddtree", 1.0, True, BudgetPlanner),  # rejection sampling reaches nodes by other odds than draft products
    ("ddtree", 0.0, False, BudgetPlanner),
])
def test_auto_chooses_stepwise_budgets_for_greedy_marginal_trees(monkeypatch, method, temperature, stepwise, planner):
    from omegaconf import OmegaConf

    from weaver.eval import run

    monkeypatch.setattr(run, "step_costs", lambda models, cfg, method, stepwise: {1: 1.0, 4: 2.0})
    auto = {"stepwise": stepwise, "explore_every": 8, "decay": 0.98, "explore_reach": 1.75}
    cfg = OmegaConf.create({"eval": {"temperature": temperature, "auto_budget": auto}})
    assert type(run.auto_planner({}, cfg, method)) is planner
