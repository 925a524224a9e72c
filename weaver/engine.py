"""Speculative generation (reference engine, batch 1): draft a block, verify it as a tree, commit.

Verification never writes the committed target state: `TargetModel.verify` leaves GDN states and conv
windows untouched and puts attention KV in scratch slots; `TargetModel.commit` keeps only the accepted
path (rollback-free, docs/method.md §2.6). The drafter's context cache grows by the committed tokens' taps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from weaver.acceptance import SAMPLING_RULES, check_finite, greedy_tree
from weaver.budget import StepCosts
from weaver.calibration import AcceptanceTable
from weaver.builders import (
    SearchConfig, StepInputs, check_budget, check_children, default_children, propose, tree_method,
)
from weaver.errors import WeaverError
from weaver.generate import sample_next, until_eos
from weaver.models.adapter import WeaverAdapter, check_adapter_fits
from weaver.models.compile import Compile
from weaver.models.config import check_prompt, is_count, is_finite_number
from weaver.models.drafter import Drafter, check_pair
from weaver.models.target import TargetModel, verify_size
from weaver.search import Proposal

# Where a decode's time goes: reading the prompt (the target's prefill, the drafter's context), then per step the
# drafter's block, the tree search (the adapter's calls for Weaver), the target's verify pass, the acceptance rule,
# and committing the path (target cache + drafter context).
PHASES = ("prefill", "draft", "search", "verify", "accept", "commit")


@dataclass
class SpecStats:
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verify step
    budgets: list[int] = field(default_factory=list)  # each step's budget (it varies with budget: auto)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def tau(self) -> float:
        """Committed tokens per target verify step, the bonus token included."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))

    @classmethod
    def merge(cls, stats: list["SpecStats"]) -> "SpecStats":
        return cls([a for s in stats for a in s.accepted], [b for s in stats for b in s.budgets],
                   {p: sum(s.seconds[p] for s in stats) for p in PHASES})


class PhaseClock:
    """Adds the wall time since the last lap to a phase. On a GPU each lap synchronises, so that queued
    work is charged to the phase that queued it (this costs some overlap: profile, don't race, with it)."""

    def __init__(self, seconds: dict[str, float], device: torch.device):
        self.seconds, self.sync = seconds, torch.cuda.synchronize if device.type == "cuda" else None
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now


def check_request(
    target: TargetModel, drafter: Drafter, prompt: list[int], max_new_tokens: int, temperature: float, method: str,
    budget: "int | StepCosts | None", adapter: WeaverAdapter | None, sampling: str, children: int,
    nodes_per_call: int | None, rescore: int | None = None, draft_temperature: float | None = None,
    fixed_children: int = 0,
) -> int:
    """Refuse a bad speculative request before any model runs, with one clear message; returns the largest
    budget a step may take. O(len(prompt)) on the host."""
    kind = tree_method(method)
    if sampling not in SAMPLING_RULES:
        raise WeaverError(f"unknown sampling rule '{sampling}'; available: {', '.join(SAMPLING_RULES)}")
    if not is_finite_number(temperature) or temperature < 0:
        raise WeaverError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if draft_temperature is not None and (not is_finite_number(draft_temperature) or draft_temperature <= 0):
        raise WeaverError(f"draft_temperature must be a finite number > 0 or null, got {draft_temperature!r}")
    if not is_count(fixed_children, 0):
        raise WeaverError(f"fixed_children must be a whole number >= 0, got {fixed_children!r}")
    if fixed_children and temperature > 0 and sampling != "rrs":
        raise WeaverError(f"fixed_children needs sampling 'rrs' (it reaches fixed children by its residual draw), "
                          f"got '{sampling}'")
    check_prompt(target.cfg, prompt, max_new_tokens)
    if isinstance(drafter, Drafter):
        check_pair(target, drafter)
    if not is_count(children):
        raise WeaverError(f"weaver.search.children must be a whole number >= 1, got {children!r}")
    if nodes_per_call is not None and not is_count(nodes_per_call):
        raise WeaverError(f"weaver.search.nodes_per_call must be a whole number >= 1 or null, got {nodes_per_call!r}")
    if rescore is not None and not is_count(rescore):
        raise WeaverError(f"weaver.search.rescore must be a whole number >= 1 or null, got {rescore!r}")
    depth = drafter.cfg.block_size - 1
    pool = None
    if "adapter" in kind.needs:
        if adapter is None:
            raise WeaverError(f"method '{method}' needs a trained adapter (stage `weaver` of train.py)")
        check_adapter_fits(adapter.cfg, target, depth)
        pool = adapter.cfg.pool_size
        check_children(children, pool)
    limit, why = kind.limit(depth, target.cfg.vocab_size, children, pool)
    if isinstance(budget, StepCosts):
        for candidate in [*budget.candidates, budget.largest]:
            check_budget(candidate, limit, method, why)
        return budget.largest
    budget = depth if budget is None else budget
    check_budget(budget, limit, method, why)
    return budget


@torch.inference_mode()
def speculative_generate(
    target: TargetModel,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    method: str = "chain",
    budget: int | StepCosts | None = None,
    adapter: WeaverAdapter | None = None,
    sampling: str = "rrs",
    children: int | None = None,
    nodes_per_call: int | None = None,
    compiled: Compile = False,
    priority: AcceptanceTable | None = None,
    rescore: int | None = None,
    draft_temperature: float | None = None,
    fixed_children: int = 0,
    on_step: Callable[[Proposal, int, torch.Tensor], None] | None = None,
) -> tuple[list[int], SpecStats]:
    """New tokens for one prompt with draft trees, plus acceptance statistics.

    method: chain (DFlash), ddtree, weaver (needs `adapter`) or oracle (`weaver.builders`); budget: draft
    nodes per step (default: block_size - 1), or a planner choosing each step's (`weaver.budget`: `BudgetPlanner`
    before the step from running means, `StepwisePlanner` from the step's own tree).
    Greedy (temperature 0) follows the target's argmax through a k-best tree. Sampling: `rrs` draws each
    node's children without replacement from its draft distribution and verifies by recursive rejection
    sampling, `traversal` verifies the same trees leaf first with sequence-level weights (Weng et al. 2025);
    `target_only` verifies the greedy tree by sampling from the target alone. All are lossless.
    compiled: run the drafter's block (`Drafter.draft`), the target's verify pass (`TargetModel.verify`) and
    the Weaver search's adapter step (`WeaverAdapter.scorer`) compiled, in that inductor mode (`weaver.models.compile`); trees can differ from eager ones only at float near-ties of the
    adapter's scores, and greedy acceptance only at near-ties of the target's logits (tested equal). children: the
    Weaver search's children per node (default 8, or the adapter's pool when smaller). priority: with `rrs`,
    rank the tree's nodes by this table's estimate of how often the rule reaches them (`weaver.calibration`),
    which this call keeps learning from its steps (pass one table across a run's prompts); None: by draft
    probability. rescore: greedy Weaver trees in one adapter call, from the drafter's best `rescore` x budget
    nodes (`weaver.builders.rescored_weaver_tree`); None: the wave search. draft_temperature: with `rrs`, draw the
    trees from the draft distribution (drafter or adapter) at this temperature instead of `temperature`; rejection
    sampling is lossless for any draft distribution, so only acceptance changes (a sharper draft, < temperature,
    is accepted more often when the drafter is weak). fixed_children: with `rrs`, each node's that many most probable
    children are taken as they are and the rest drawn from the mass outside them; the rule reaches a fixed child
    when its residual draw lands on it (lossless; `weaver.search`). on_step: called after each step's acceptance with the step's
    proposal, the accepted node and the target's logits of the tree's nodes (rows past the tree: a compiled
    verify's padding) (diagnostics, e.g. `benchmarks/tree_calibration.py`, `benchmarks/sampling_rules.py`).

    Bad input (`check_request`) raises `WeaverError` before any model runs; so do NaN/inf logits of the
    target or the drafter (and NaN scores of the adapter), naming the step, instead of a wrong token.
    """
    if children is None:
        children = default_children(adapter.cfg.pool_size if adapter is not None else None)
    max_budget = check_request(target, drafter, prompt, max_new_tokens, temperature, method, budget, adapter, sampling,
                               children, nodes_per_call, rescore, draft_temperature, fixed_children)
    planner = budget if isinstance(budget, StepCosts) else None
    budget = max_budget
    device = target.embed.weight.device
    taps, block = drafter.cfg.target_layer_ids, drafter.cfg.block_size
    max_len = len(prompt) + max_new_tokens + verify_size(max(block, max_budget + 1))  # + verify's scratch slots
    cache, context = target.new_cache(1, max_len), drafter.new_cache(1, max_len)
    ids = torch.tensor([prompt], device=device)
    stats = SpecStats()
    clock = PhaseClock(stats.seconds, device)
    out = target.prefill(ids, cache, tap_layers=taps)
    check_finite(out.logits, "the target's logits", f"at the prefill ({len(prompt)} prompt tokens)")
    drafter.extend_context(context, out.taps, torch.arange(len(prompt), device=device)[None])
    anchor, hidden = sample_next(out.logits[:, -1], temperature, generator), out.hidden[0, -1]
    rule = SAMPLING_RULES[sampling] if temperature > 0 else None  # None: greedy acceptance
    drawn = rule is not None and rule.draws_trees
    tree_temperature = (draft_temperature or temperature) if drawn else 1.0
    scored_by_adapter = "adapter" in tree_method(method).needs
    new = [int(anchor)]
    clock.lap("prefill")
    while len(new) < max_new_tokens and new[-1] != eos_token_id:
        step_budget = planner.next_budget() if planner else budget
        clock.lap("commit")  # the bookkeeping since the last step
        step_start = clock.last
        # a tree of b nodes is at most b deep: the drafter's logits beyond that would go unused
        step = len(stats.accepted) + 1
        draft = drafter.draft(target, context, anchor, cache.next_position, max_depth=step_budget, compiled=compiled)
        check_finite(draft.logits, "the drafter's logits", f"at speculative step {step}",
                     computed_in=drafter.dtype, setting="drafter.dtype")
        clock.lap("draft")
        proposal = propose(method, StepInputs(int(anchor), draft, hidden, target, cache, adapter), SearchConfig(
            step_budget, children, nodes_per_call, generator if drawn else None, tree_temperature, compiled,
            anytime=planner is not None, priority=priority if drawn else None, rescore=rescore,
            fixed_children=fixed_children if drawn else 0))
        if planner and (cut := planner.cut(proposal)) is not proposal:  # verify the first nodes only
            proposal, step_budget = cut, len(cut.tree) - 1
        tree = proposal.tree
        if scored_by_adapter:
            check_finite(torch.cat([lp.flatten() for _, lp, _ in proposal.expansions]), "the Weaver adapter's scores",
                         f"at speculative step {step}", nan_only=True)
        clock.lap("search")
        anchor_position = cache.next_position.clone()
        verified, pending = target.verify(tree, cache, taps, compiled, step_budget)
        logits = verified.logits[0]
        check_finite(logits, "the target's logits", f"at speculative step {step} (verify of {len(tree)} tree nodes)")
        clock.lap("verify")
        if rule is None:
            leaf, bonus = greedy_tree(tree, logits)
        else:
            leaf, bonus = rule.accept(tree, logits, proposal, temperature, generator,
                                      priority.observer(proposal) if drawn and priority else None)
        path = tree.path_to(leaf)
        if on_step:
            on_step(proposal, leaf, logits)
        clock.lap("accept")
        target.commit(cache, pending, leaf=leaf)
        positions = anchor_position[:, None] + torch.arange(len(path), device=device)
        drafter.extend_context(context, [t[:, path] for t in verified.taps], positions)
        new += tree.tokens[path[1:]].tolist() + [bonus]
        anchor, hidden = torch.tensor([bonus], device=device), verified.hidden[0, leaf]
        stats.accepted.append(len(path) - 1)
        stats.budgets.append(step_budget)
        if planner:
            planner.observe(step_budget, path[1:].tolist(), time.perf_counter() - step_start)
        if drawn and priority:
            priority.refresh()
    clock.lap("commit")
    return until_eos(new[:max_new_tokens], eos_token_id), stats
