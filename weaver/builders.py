"""Tree builders: from per-node child distributions to a draft tree under a node budget (docs/method.md §2.4).

Every builder returns a `weaver.search.Proposal`: a `Tree` whose node 0 is the anchor (the last committed
token) and whose other nodes, at most `budget` of them, are draft tokens in topological order, plus the
distribution each expanded node's children were taken from (what draft-aware acceptance needs).

All builders are one best-first search (`weaver.search.best_first_tree`) and differ in the child
distributions:

- chain: the drafter's per-depth marginals, one child per node (DFlash).
- ddtree: the same marginals, up to `width` children per node: path score = sum of log-marginals.
- weaver: the adapter's conditional distribution given the path (`weaver.models.adapter`).
- oracle: the target's own conditionals (verifying the tree grown so far): not deployable, it is
  the τ ceiling for a budget.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from weaver.errors import WeaverError
from weaver.models.adapter import WeaverAdapter, draft_pools
from weaver.search import ChildLogProbs, Grown, Proposal, best_first_tree


def marginal_logprobs(draft_logits: torch.Tensor, temperature: float = 1.0, keep: int | None = None) -> ChildLogProbs:
    """Children of a node at depth d are scored by the drafter's marginal at block position d + 1.

    keep: return only each depth's `keep` most likely tokens (as a support), computed once: all a greedy
    search with `keep` children per node can take. Sampling needs the whole rows (keep=None)."""
    log_marginals = (draft_logits.float() / temperature).log_softmax(-1)
    if keep is None:
        return lambda nodes, grown: log_marginals[grown.depths[nodes]]
    values, tokens = log_marginals.topk(min(keep, log_marginals.shape[-1]), dim=-1)
    return lambda nodes, grown: (values[grown.depths[nodes]], tokens[grown.depths[nodes]])


def marginal_tree(anchor: int, draft_logits: torch.Tensor, budget: int, width: int,
                  generator: torch.Generator | None, temperature: float) -> Proposal:
    """Best-first over the factorized marginals draft_logits (D, V): depth d scores use row d - 1."""
    child_logprobs = marginal_logprobs(draft_logits, temperature, None if generator else width)
    return best_first_tree(anchor, budget, len(draft_logits), child_logprobs, width, generator=generator,
                           vocab_size=draft_logits.shape[-1], device=draft_logits.device)


def chain_tree(anchor: int, draft_logits: torch.Tensor, budget: int, generator: torch.Generator | None = None,
               temperature: float = 1.0) -> Proposal:
    """DFlash's chain: the argmax (or one draw) per depth, `budget` drafts at most."""
    return marginal_tree(anchor, draft_logits, budget, 1, generator, temperature)


def ddtree(anchor: int, draft_logits: torch.Tensor, budget: int, generator: torch.Generator | None = None,
           temperature: float = 1.0) -> Proposal:
    """DDTree: up to `budget` children per node under the factorized marginals."""
    return marginal_tree(anchor, draft_logits, budget, min(budget, draft_logits.shape[-1]), generator, temperature)


def oracle_tree(anchor: int, budget: int, max_depth: int, target, cache, generator: torch.Generator | None = None,
                temperature: float = 1.0, nodes_per_call: int | Callable[[int], int] = 1) -> Proposal:
    """Best-first over the target's own conditionals: each call verifies the tree grown so far in one
    target pass (the committed cache is untouched) and reads the new nodes' next-token distributions."""
    device = target.embed.weight.device

    def logprobs(nodes: torch.Tensor, grown: Grown) -> torch.Tensor:
        logits = target.verify(grown.tree(), cache)[0].logits[0, nodes]
        return (logits.float() / temperature).log_softmax(-1)

    return best_first_tree(anchor, budget, max_depth, logprobs, min(budget, target.cfg.vocab_size),
                           nodes_per_call, generator, device=device)


def weaver_tree(
    anchor: int, budget: int, adapter: WeaverAdapter, target, draft_logits: torch.Tensor, draft_hidden: torch.Tensor,
    target_hidden: torch.Tensor, width: int, nodes_per_call: int | Callable[[int], int],
    generator: torch.Generator | None = None, temperature: float = 1.0, compiled: bool = False,
) -> Proposal:
    """Best-first over the adapter's path-conditional distributions on the drafter's top-M pools.

    draft_logits/draft_hidden (D, V)/(D, H) from `Drafter.draft`; target_hidden (H,) the target's
    final-norm state of the token before the anchor. Each adapter call scores `nodes_per_call` new
    nodes, which attend to the prefix memory and to their ancestors (scored in earlier calls); compiled:
    through the compiled adapter step (`WeaverAdapter.scorer`).
    """
    pool_logits, pool_tokens = draft_pools(draft_logits, adapter.cfg.pool_size)
    candidates = adapter.candidate_table(target)[pool_tokens]  # (D, M, r), constant for this step
    # adapter-cache slot of a node = its index in the tree, so a node's mask row is its ancestor row
    cache = adapter.start(adapter.prefix(target_hidden[None], draft_hidden[None]), capacity=budget + 1)
    score = adapter.scorer(compiled)

    def logprobs(nodes: torch.Tensor, grown: Grown) -> tuple[torch.Tensor, torch.Tensor]:
        depths = grown.depths[nodes]
        scores = score(target, grown.tokens[nodes], depths, grown.ancestors[nodes], nodes, cache, pool_logits[depths],
                       candidates[depths])
        return (scores / temperature).log_softmax(-1), pool_tokens[depths]

    return best_first_tree(anchor, budget, len(draft_logits), logprobs, min(width, adapter.cfg.pool_size),
                           nodes_per_call, generator, vocab_size=draft_logits.shape[-1], device=candidates.device)


def max_tree_nodes(max_depth: int, branching: int) -> int:
    """The most draft nodes a tree can hold when it is at most `max_depth` deep and a node has at most
    `branching` children: branching + branching^2 + ... + branching^max_depth (capped at 2^62)."""
    total, level = 0, 1
    for _ in range(max_depth):
        level *= branching
        total += level
        if total >= 2**62:
            return 2**62
    return total


def budget_limit(method: str, max_depth: int, vocab_size: int, children: int, pool_size: int | None = None) -> tuple[int, str]:
    """(most draft nodes a step's tree can hold, why) for a method; no larger budget can be filled.

    chain: one node per depth, so the drafter's block (block_size - 1 = max_depth). ddtree and oracle:
    every path of at most max_depth tokens of the vocabulary. weaver: `children` per node (at most the
    adapter's pool)."""
    if method == "chain":
        return max_depth, f"one node per drafted position, block_size - 1 = {max_depth}"
    if method == "weaver":
        branching = min(children, pool_size or children)
        return max_tree_nodes(max_depth, branching), f"depth {max_depth} x {branching} children per node"
    return max_tree_nodes(max_depth, vocab_size), f"depth {max_depth} x vocabulary {vocab_size}"


def check_budget(budget: int, limit: int | None = None, method: str = "tree", why: str = "") -> None:
    """A step's budget: a whole number of draft nodes, at least 1, and (given `limit`) no more than the
    method's tree can hold (`budget_limit`)."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise WeaverError(f"tree budget must be a whole number of draft nodes (>= 1) or a BudgetPlanner, got {budget!r}")
    if budget < 1:
        raise WeaverError(f"tree budget must be at least 1 draft node, got {budget}")
    if limit is not None and budget > limit:
        raise WeaverError(f"budget {budget} is more than a {method} tree can hold: at most {limit} draft nodes ({why})")
