"""Greedy trees in tensor ops of static shapes: no host round trip and no data-dependent size, so that
torch.compile traces a whole step's search into one graph (per budget) instead of dozens of small eager ops.

- `best_paths_nodes`: the greedy DDTree's nodes under the factorized marginals (`weaver.builders.best_paths`).
- `rescore_candidates`: the rescored Weaver tree's core (`weaver.builders.rescored_weaver_tree`): the drafter's
  best `rescore` x budget nodes, every one scored in one adapter call, ranked by the adapter's path scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from weaver.models.adapter import WeaverAdapter, draft_pools
from weaver.models.compile import Compile, compile_step, inductor_mode
from weaver.models.drafter import in_vocab, proposable
from weaver.tree import ancestor_matrix

if TYPE_CHECKING:
    from weaver.models.target import TargetModel


def best_paths_nodes(anchor: torch.Tensor, top_logp: torch.Tensor, top_tokens: torch.Tensor,
                     budget: int) -> tuple[torch.Tensor, ...]:
    """(tokens, parents, depths) of the greedy DDTree's nodes, best first, node 0 the anchor (a (1,) tensor).

    A path scores at most its prefix (log-probs are <= 0), so the `budget` best nodes are closed under
    prefixes, each is among the `budget` best of its depth, and its token among its depth's top `budget`:
    given each depth's top min(budget, V) log-marginals and tokens, best first (top_logp, top_tokens: (D, k)),
    a beam of `budget` nodes per depth, then one stable sort of all of them (ties: shallower first, so a
    parent precedes its children and the anchor comes first)."""
    k, device = top_logp.shape[1], top_logp.device
    scores, parents = [torch.zeros(1, device=device)], [torch.full((1,), -1, device=device)]
    tokens, depths = [anchor], [torch.zeros(1, dtype=torch.long, device=device)]
    beam, beam_ids = scores[0], torch.zeros(1, dtype=torch.long, device=device)  # depth d - 1's best nodes
    for d in range(len(top_logp)):
        beam, index = (beam[:, None] + top_logp[d]).flatten().topk(min(budget, len(beam) * k))
        scores.append(beam)
        parents.append(beam_ids[index // k])
        tokens.append(top_tokens[d, index % k])
        depths.append(torch.full_like(index, d + 1))
        beam_ids = beam_ids[-1] + 1 + torch.arange(len(index), device=device)
    order = torch.cat(scores).sort(descending=True, stable=True).indices[: budget + 1]
    return torch.cat(tokens)[order], kept_parents(torch.cat(parents), order), torch.cat(depths)[order]


def kept_parents(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The parents of the nodes `keep` (ids into `parents`, each after its parent) as indices into `keep`."""
    new_id = torch.full_like(parents, -1)
    new_id[keep] = torch.arange(len(keep), device=keep.device)
    old = parents[keep]
    return torch.where(old >= 0, new_id[old.clamp(min=0)], -1)


class Rescored(NamedTuple):
    keep: torch.Tensor  # (budget + 1,) candidate ids by adapter path score, best first; only the first n_kept are finite
    n_kept: torch.Tensor  # () long
    tokens: torch.Tensor  # (n,) the candidates' tokens, candidate 0 the anchor
    parents: torch.Tensor  # (n,)
    ancestors: torch.Tensor  # (n, n) bool
    depths: torch.Tensor  # (n,)
    logprobs: torch.Tensor  # (n, M): each candidate's children's adapter log-probs over its depth's pool
    pool_tokens: torch.Tensor  # (D, M): the drafter's top-M tokens per depth


def rescore_candidates(adapter: WeaverAdapter, target: TargetModel, table: torch.Tensor, anchor: torch.Tensor,
                       draft_logits: torch.Tensor, draft_hidden: torch.Tensor, target_hidden: torch.Tensor,
                       budget: int, rescore: int, children: int, vocab: torch.Tensor | None = None) -> Rescored:
    """The candidates (the drafter's best `rescore` x budget nodes over draft_logits (D, V), D <= budget) scored
    in one adapter call and ranked by the adapter's path scores. table: P lm_head over the vocabulary
    (`WeaverAdapter.candidate_table`); draft_hidden (block - 1, H) and target_hidden (H,) make the prefix;
    vocab: the drafter's draft vocabulary (`Draft.vocab`), whose columns alone the top-k and normaliser read.

    A candidate's adapter log-prob is its token's in its parent's pool distribution (-inf unless the token is
    among the parent's `children` best); its path score, the sum along its path, never exceeds its parent's.
    Every candidate is scored, the deepest ones too (their rows go unused: they are nobody's ancestor, so no
    other score changes), which keeps every shape fixed by (D, budget, rescore)."""
    depth = len(draft_logits)
    columns = proposable(draft_logits, vocab)
    pool_logits, pool_tokens = draft_pools(columns, adapter.cfg.pool_size, vocab)
    k = min(rescore * budget, columns.shape[-1])
    if k <= pool_logits.shape[-1]:  # the pool holds each depth's top k: one top-k over the vocabulary, not two
        top = pool_logits[:, :k].float() - columns.float().logsumexp(-1, keepdim=True), pool_tokens[:, :k]
    else:
        top_logp, top_index = columns.float().log_softmax(-1).topk(k, dim=-1)
        top = top_logp, in_vocab(top_index, vocab)
    tokens, parents, depths = best_paths_nodes(anchor, *top, rescore * budget)
    n = len(tokens)
    ancestors = ancestor_matrix(parents, depth)
    pool_rows = depths.clamp(max=depth - 1)  # the deepest candidates' (unused) rows read the last pool
    cache = adapter.start(adapter.prefix(target_hidden[None], draft_hidden[None]), n)
    scores = adapter.score_nodes(target, tokens, depths, ancestors, torch.arange(n, device=tokens.device), cache,
                                 pool_logits[pool_rows], table[pool_tokens[pool_rows]])
    logprobs = scores.log_softmax(-1)  # (n, M): row i holds candidate i's children
    siblings = logprobs[parents[1:]]  # (n - 1, M): each candidate's parent's children
    in_pool = pool_tokens[depths[parents[1:]]] == tokens[1:, None]  # (n - 1, M), one True at most
    own = siblings.gather(1, in_pool.int().argmax(-1, keepdim=True))
    rank = (siblings > own).sum(-1)
    own = torch.where(in_pool.any(-1) & (rank < children), own.squeeze(1), -math.inf)
    # path scores level by level, parent's + own (a sum over each row of the ancestor matrix could let a child
    # outrank its parent by a rounding); -inf below any excluded candidate
    path = own.new_zeros(n)
    for _ in range(depth):
        path = torch.cat([path.new_zeros(1), path[parents[1:]] + own])
    # best first (`budget: auto` reads smaller budgets' trees as prefixes); on a tie the earlier candidate, so
    # a parent precedes its children and the anchor (path score 0) comes first
    keep = path.sort(descending=True, stable=True).indices[: budget + 1]
    return Rescored(keep, (path[keep] > -math.inf).sum(), tokens, parents, ancestors, depths, logprobs, pool_tokens)


_COMPILED: dict[str, Callable[..., Rescored]] = {}  # by inductor mode


def rescorer(compiled: Compile = False) -> Callable[..., Rescored]:
    """`rescore_candidates`, eager or compiled once per inductor mode: static shapes, a graph per (budget,
    rescore, children) and adapter. On a CPU the eager version is ~60 small ops, most of a step's search."""
    if not compiled:
        return rescore_candidates
    mode = inductor_mode(compiled)
    if mode not in _COMPILED:
        _COMPILED[mode] = compile_step(rescore_candidates, mode, dynamic=False)
    return _COMPILED[mode]
