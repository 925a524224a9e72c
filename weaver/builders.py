"""Tree builders: from the drafter's per-depth scores to a draft tree under a node budget (DESIGN.md §2.4).

Every builder returns a `Tree` whose node 0 is the anchor (the last committed token) and whose other
nodes, at most `budget` of them, are draft tokens in topological order.

- chain: the argmax at each depth (DFlash).
- ddtree: best-first search over the factorized marginals; a path's score is the sum of its per-depth
  log-marginals. Marginals do not depend on the path, so every node's children come in the same
  order (the depth's ranking), and the k-best search only needs "next child" and "next sibling" moves.
- oracle: the same search scored by the target's own conditional log-probs (computed by running the
  target on each expanded node's path): not deployable, it is the τ ceiling for a budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from weaver.errors import WeaverError
from weaver.tree import Tree

# scores(parent node index, parent's path tokens) -> log-probs (V,) of its children's tokens
ChildScores = Callable[[int, list[int]], torch.Tensor]


def chain_tree(anchor: int, draft_logits: torch.Tensor, budget: int) -> Tree:
    tokens = torch.cat([torch.tensor([anchor]), draft_logits[:budget].argmax(-1).cpu()])
    return Tree.chain(tokens)


def best_first_tree(anchor: int, budget: int, max_depth: int, child_scores: ChildScores, width: int) -> Tree:
    """k-best expansion: pop the best-scoring candidate, add it, push its first child and next sibling.

    A candidate is (score, parent node, rank r): the parent's r-th best child. Ranks are limited to
    `width` per node (`budget` is the natural bound).
    """
    tokens, parents, depths, paths = [anchor], [-1], [0], [[anchor]]
    ranked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # node -> (sorted log-probs, tokens)

    def candidate(parent: int, rank: int, base: float) -> tuple[float, int, int] | None:
        if depths[parent] >= max_depth or rank >= width:
            return None
        if parent not in ranked:
            values, order = child_scores(parent, paths[parent]).float().topk(width)
            ranked[parent] = (values.cpu(), order.cpu())
        return (-(base + float(ranked[parent][0][rank])), parent, rank)

    scores = [0.0]
    heap = [c for c in [candidate(0, 0, 0.0)] if c is not None]
    while heap and len(tokens) <= budget:
        neg, parent, rank = heapq.heappop(heap)
        node = len(tokens)
        token = int(ranked[parent][1][rank])
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        paths.append(paths[parent] + [token])
        scores.append(-neg)
        for c in (candidate(node, 0, -neg), candidate(parent, rank + 1, scores[parent])):
            if c is not None:
                heapq.heappush(heap, c)
    return Tree(torch.tensor(tokens), torch.tensor(parents))


def ddtree(anchor: int, draft_logits: torch.Tensor, budget: int) -> Tree:
    """Best-first over the factorized marginals draft_logits (D, V): depth d scores use row d - 1."""
    log_marginals = draft_logits.float().log_softmax(-1)

    def scores(parent: int, path: list[int]) -> torch.Tensor:
        return log_marginals[len(path) - 1]

    return best_first_tree(anchor, budget, len(draft_logits), scores, min(budget, draft_logits.shape[-1]))


def oracle_tree(anchor: int, budget: int, max_depth: int, target, cache) -> Tree:
    """Best-first over the target's own conditionals: each expanded node's children are scored by
    running the target on that node's path (a verify pass, so the committed cache is untouched)."""
    device = target.embed.weight.device

    def scores(parent: int, path: list[int]) -> torch.Tensor:
        logits = target.verify(Tree.chain(torch.tensor(path, device=device)), cache)[0].logits[0, -1]
        return logits.float().log_softmax(-1)

    return best_first_tree(anchor, budget, max_depth, scores, min(budget, target.cfg.vocab_size))


def check_budget(budget: int) -> None:
    if budget < 1:
        raise WeaverError(f"tree budget must be at least 1 draft node, got {budget}")
