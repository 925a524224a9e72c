"""Tree builders: from per-node child distributions to a draft tree under a node budget (docs/method.md §2.4).

Every builder returns a `Proposal`: a `Tree` whose node 0 is the anchor (the last committed token) and
whose other nodes, at most `budget` of them, are draft tokens in topological order, plus the
distribution each expanded node's children were taken from (what draft-aware acceptance needs).

All builders are one best-first search (`best_first_tree`) over "slots": a slot is the next child of an
expanded node, and its priority is the node's path score plus the log of the mass its next child
takes. The builders differ in the child distributions:

- chain: the drafter's per-depth marginals, one child per node (DFlash).
- ddtree: the same marginals, up to `width` children per node: path score = sum of log-marginals.
- weaver: the adapter's conditional distribution given the path (`weaver.models.adapter`).
- oracle: the target's own conditionals (verifying the tree grown so far): not deployable, it is
  the τ ceiling for a budget.

Greedy decoding takes each node's children in order of probability (k-best search). Sampling draws them
without replacement from the node's distribution; a slot's priority then uses the mass still undrawn,
which depends only on the children drawn before it, so whether a child exists never depends on its own
value: the condition recursive rejection sampling (`weaver.verify.recursive_rejection_tree`) needs.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weaver.errors import WeaverError
from weaver.models.adapter import WeaverAdapter, draft_pools
from weaver.tree import Tree


@dataclass
class Grown:
    """The tree so far, as the search grows it (node-indexed lists)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    paths: list[list[int]]  # root-to-node tokens


# child_logprobs(nodes, tree so far) -> the children's log-probs of each node: a (len(nodes), V) tensor
# over the vocabulary, or (logprobs, tokens), each (len(nodes), K), over a support of K tokens per row
ChildLogProbs = Callable[[list[int], Grown], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class Proposal:
    tree: Tree
    supports: dict[int, tuple[torch.Tensor, torch.Tensor | None]]  # expanded node -> (log-probs, tokens or None)
    vocab_size: int | None  # needed only for supports given as tokens

    @functools.cached_property
    def child_probs(self) -> dict[int, torch.Tensor]:
        """Expanded node -> (V,) distribution its children were taken from (what acceptance reads)."""
        return {node: _on_vocab(logprobs, tokens, self.vocab_size) for node, (logprobs, tokens) in self.supports.items()}


def _on_vocab(logprobs: torch.Tensor, tokens: torch.Tensor | None, vocab_size: int | None) -> torch.Tensor:
    probs = logprobs.float().exp()
    return probs if tokens is None else probs.new_zeros(vocab_size).scatter_(0, tokens, probs)


class _Children:
    """The children of one expanded node: in order of probability (given as lists), or drawn without
    replacement from the node's distribution over its support."""

    def __init__(self, width: int, best: tuple[list[float], list[int]] | None = None,
                 support: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                 generator: torch.Generator | None = None):
        self.width, self.count, self.generator = width, 0, generator
        if best is not None:
            self.values, self.tokens = best
        else:
            logprobs, self.support = support
            self.logprobs = logprobs.float()
            self.undrawn = self.logprobs.exp()

    def next_log_mass(self) -> float | None:
        """Log of the mass the next child takes (greedy: its probability; sampled: the undrawn mass)."""
        if self.count >= self.width:
            return None
        if self.generator is None:
            return self.values[self.count] if self.count < len(self.values) else None
        mass = float(self.undrawn.sum())
        return math.log(mass) if mass > 1e-12 else None

    def take(self) -> tuple[int, float]:
        """(token, log-prob) of the next child."""
        if self.generator is None:
            token, logprob = self.tokens[self.count], self.values[self.count]
        else:
            index = int(torch.multinomial(self.undrawn, 1, generator=self.generator))
            token = index if self.support is None else int(self.support[index])
            logprob = float(self.logprobs[index])
            self.undrawn[index] = 0.0
        self.count += 1
        return token, logprob


def best_first_tree(
    anchor: int, budget: int, max_depth: int, child_logprobs: ChildLogProbs, width: int,
    nodes_per_call: int = 1, generator: torch.Generator | None = None, vocab_size: int | None = None, *,
    device: torch.device | str,
) -> Proposal:
    """Best-first search over slots (see the module doc): pop up to `nodes_per_call` best slots, add their
    children to the tree, then expand the new nodes with one `child_logprobs` call.

    generator None: greedy (k-best) order; otherwise children are drawn without replacement.
    vocab_size: needed when `child_logprobs` returns supports rather than vocabulary rows.
    device: where the tree goes (the target's): the search itself runs on the host.
    """
    grown = Grown([anchor], [-1], [0], [[anchor]])
    tokens, parents, depths, paths, scores = grown.tokens, grown.parents, grown.depths, grown.paths, [0.0]
    children: dict[int, _Children] = {}
    supports: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    heap: list[tuple[float, int, int]] = []  # (-priority, tie-break, node whose next child this slot is)

    def push_slot(node: int) -> None:
        log_mass = children[node].next_log_mass()
        if log_mass is not None:
            heapq.heappush(heap, (-(scores[node] + log_mass), len(tokens), node))

    def expand(nodes: list[int]) -> None:
        nodes = [n for n in nodes if depths[n] < max_depth]
        if not nodes:
            return
        out = child_logprobs(nodes, grown)
        logprobs, support = (out, None) if isinstance(out, torch.Tensor) else out
        logprobs = logprobs.detach().float().cpu()
        if support is not None and vocab_size is None:
            raise WeaverError("best_first_tree needs vocab_size when child_logprobs returns token supports")
        support = None if support is None else support.cpu()
        if generator is None:  # one top-k for the whole batch, read back as Python lists
            values, index = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
            best = zip(values.tolist(), (index if support is None else support.gather(1, index)).tolist())
        for j, n in enumerate(nodes):
            supports[n] = (logprobs[j], None if support is None else support[j])
            children[n] = _Children(width, next(best)) if generator is None else _Children(width, None, supports[n], generator)
            push_slot(n)

    expand([0])
    while heap and len(tokens) <= budget:
        new: list[int] = []
        while heap and len(new) < nodes_per_call and len(tokens) <= budget:
            _, _, parent = heapq.heappop(heap)
            token, logprob = children[parent].take()
            new.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            paths.append(paths[parent] + [token])
            scores.append(scores[parent] + logprob)
            push_slot(parent)
        if len(tokens) <= budget:
            expand(new)
    tree = Tree(torch.tensor(tokens, device=device), torch.tensor(parents, device=device))
    return Proposal(tree, supports, vocab_size)


def marginal_logprobs(draft_logits: torch.Tensor, temperature: float = 1.0) -> ChildLogProbs:
    """Children of a node at depth d are scored by the drafter's marginal at block position d + 1."""
    log_marginals = (draft_logits.float() / temperature).log_softmax(-1)
    return lambda nodes, grown: log_marginals[[grown.depths[n] for n in nodes]]


def chain_tree(anchor: int, draft_logits: torch.Tensor, budget: int, generator: torch.Generator | None = None,
               temperature: float = 1.0) -> Proposal:
    """DFlash's chain: the argmax (or one draw) per depth, `budget` drafts at most."""
    return best_first_tree(anchor, budget, len(draft_logits), marginal_logprobs(draft_logits, temperature), 1,
                           generator=generator, device=draft_logits.device)


def ddtree(anchor: int, draft_logits: torch.Tensor, budget: int, generator: torch.Generator | None = None,
           temperature: float = 1.0) -> Proposal:
    """Best-first over the factorized marginals draft_logits (D, V): depth d scores use row d - 1."""
    return best_first_tree(anchor, budget, len(draft_logits), marginal_logprobs(draft_logits, temperature),
                           min(budget, draft_logits.shape[-1]), generator=generator, device=draft_logits.device)


def oracle_tree(anchor: int, budget: int, max_depth: int, target, cache, generator: torch.Generator | None = None,
                temperature: float = 1.0, nodes_per_call: int = 1) -> Proposal:
    """Best-first over the target's own conditionals: each call verifies the tree grown so far in one
    target pass (the committed cache is untouched) and reads the new nodes' next-token distributions."""
    device = target.embed.weight.device

    def logprobs(nodes: list[int], grown: Grown) -> torch.Tensor:
        tree = Tree(torch.tensor(grown.tokens, device=device), torch.tensor(grown.parents, device=device))
        logits = target.verify(tree, cache)[0].logits[0, nodes]
        return (logits.float() / temperature).log_softmax(-1)

    return best_first_tree(anchor, budget, max_depth, logprobs, min(budget, target.cfg.vocab_size),
                           nodes_per_call, generator, device=device)


def weaver_tree(
    anchor: int, budget: int, adapter: WeaverAdapter, target, draft_logits: torch.Tensor, draft_hidden: torch.Tensor,
    target_hidden: torch.Tensor, width: int, nodes_per_call: int, generator: torch.Generator | None = None,
    temperature: float = 1.0,
) -> Proposal:
    """Best-first over the adapter's path-conditional distributions on the drafter's top-M pools.

    draft_logits/draft_hidden (D, V)/(D, H) from `Drafter.draft`; target_hidden (H,) the target's
    final-norm state of the token before the anchor. Each adapter call scores `nodes_per_call` new
    nodes, which attend to the prefix memory and to their (already scored) ancestors.
    """
    pool_logits, pool_tokens = draft_pools(draft_logits, adapter.cfg.pool_size)
    candidates = adapter.candidate_table(target)[pool_tokens]  # (D, M, r), constant for this step
    cache = adapter.start(adapter.prefix(target_hidden[None], draft_hidden[None]))
    path_slots: dict[int, list[int]] = {}  # tree node -> adapter-cache positions of its ancestors-or-self
    device = candidates.device

    def logprobs(nodes: list[int], grown: Grown) -> tuple[torch.Tensor, torch.Tensor]:
        cached, rows, cols = len(path_slots), [], []
        for j, node in enumerate(nodes):
            parent = grown.parents[node]
            path_slots[node] = path_slots.get(parent, []) + [cached + j]
            rows += [j] * len(path_slots[node])
            cols += path_slots[node]
        sees = torch.zeros(1, len(nodes), cached + len(nodes), dtype=torch.bool, device=device)
        sees[0, rows, cols] = True
        tokens = torch.tensor([grown.tokens[n] for n in nodes], device=device)
        depths = torch.tensor([grown.depths[n] for n in nodes], device=device)
        states = adapter(adapter.node_inputs(target, tokens)[None], depths, cache, sees)[0]
        scores = adapter.pool_scores(states, pool_logits[depths], candidates[depths]) / temperature
        return scores.log_softmax(-1), pool_tokens[depths]

    return best_first_tree(anchor, budget, len(draft_logits), logprobs, min(width, adapter.cfg.pool_size),
                           nodes_per_call, generator, vocab_size=draft_logits.shape[-1], device=device)


def check_budget(budget: int) -> None:
    if budget < 1:
        raise WeaverError(f"tree budget must be at least 1 draft node, got {budget}")
