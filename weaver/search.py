"""Best-first tree search under a node budget (docs/method.md §2.4), in waves of tensor ops.

A slot is the next child of an expanded node; its priority is the node's path score plus the log of
the mass its child takes. Each wave takes the `nodes_per_call` best slots of the whole tree with one
top-k, adds their children to the tree with one scatter, and scores the new nodes' own children with one
`child_logprobs` call (one adapter call for Weaver). Within a node, slot priorities never increase, so
taking the best slots of the whole table at once is what popping them one by one from a heap gives
(`best_first_reference`, the readable version, kept beside it and tested equal).

Greedy decoding takes each node's children in order of probability (k-best search). Sampling draws them
without replacement from the node's distribution, all at once by Gumbel-top-k (a draw in that order has
the law of successive draws); a slot's priority then uses the mass still undrawn, which depends only on
the children drawn before it, so whether a child exists never depends on its own value: the condition
recursive rejection sampling (`weaver.acceptance.recursive_rejection_tree`) needs. With `fixed` children a
sampled node's `fixed` most probable children come first, taken as they are, and the rest are drawn from the
mass outside them (the draft of Hu et al. 2025's greedy multi-draft, per node); the rule reaches a fixed child
when the target's residual draw lands on it. With an
`AcceptanceTable` (`weaver.calibration`) a sampled child's share of the path score is instead the table's
estimate of the log-probability that RRS reaches it from its node.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weaver.errors import WeaverError
from weaver.tree import Tree

if TYPE_CHECKING:
    from weaver.calibration import AcceptanceTable


@dataclass
class Grown:
    """The tree so far, as the search grows it: node-indexed tensors with room for the whole budget."""

    tokens: torch.Tensor  # (capacity,) long
    parents: torch.Tensor  # (capacity,) long, -1 for the anchor
    depths: torch.Tensor  # (capacity,) long, 0 for the anchor
    scores: torch.Tensor  # (capacity,) float: sum of the path's log-probs (or calibrated log-reaches)
    ancestors: torch.Tensor  # (capacity, capacity) bool: [i, j] when j is an ancestor of i or i itself
    size: int = 1

    @classmethod
    def start(cls, anchor: int, capacity: int, device: torch.device | str) -> "Grown":
        tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        tokens[0] = anchor
        ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)
        ancestors[0, 0] = True
        return cls(tokens, torch.full_like(tokens, -1), torch.zeros_like(tokens),
                   torch.zeros(capacity, dtype=torch.float32, device=device), ancestors)

    def add(self, parents: torch.Tensor, tokens: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        """Append children (parents, tokens, their shares of the path score): one scatter per field. Returns
        their node ids."""
        new = torch.arange(self.size, self.size + len(parents), device=parents.device)
        self.tokens[new], self.parents[new] = tokens, parents
        self.depths[new] = self.depths[parents] + 1
        self.scores[new] = self.scores[parents] + gains
        self.ancestors[new] = self.ancestors[parents]
        self.ancestors[new, new] = True
        self.size += len(parents)
        return new

    def path_tokens(self, node: int) -> list[int]:
        """Root-to-node tokens (ancestors have smaller indices, so index order is path order)."""
        return self.tokens[: self.size][self.ancestors[node, : self.size]].tolist()

    def tree(self) -> Tree:
        n = self.size
        return Tree.with_ancestors(self.tokens[:n], self.parents[:n], self.ancestors[:n, :n])


# child_logprobs(nodes (n,) long, tree so far) -> the children's log-probs of each node: a (n, V) tensor over the
# vocabulary, or (logprobs, tokens), each (n, K), over a support of K tokens per row
ChildLogProbs = Callable[[torch.Tensor, Grown], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class Proposal:
    tree: Tree
    expansions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]  # (nodes, log-probs, tokens or None)
    vocab_size: int | None  # needed only for supports given as tokens
    fixed: int = 0  # sampled trees: each node's `fixed` most probable children were taken, not drawn

    @functools.cached_property
    def child_probs(self) -> dict[int, torch.Tensor]:
        """Expanded node -> (V,) distribution its drawn children were drawn from (what acceptance reads): the
        node's distribution, without its `fixed` most probable tokens (renormalised; all zero when nothing is
        left to draw), so a fixed child is the child of draft probability 0."""
        probs: dict[int, torch.Tensor] = {}
        for nodes, logprobs, support in self.expansions:
            p = without_fixed(logprobs.float(), self.fixed).exp()
            if support is not None:
                p = p.new_zeros(len(p), self.vocab_size).scatter_(1, support, p)
            probs.update(zip(nodes.tolist(), p))
        return probs

    def edge_probs(self) -> torch.Tensor:
        """(T,) each node's probability under the distribution its parent's children were taken from (1 for the
        anchor): the draft's confidence in each edge, which greedy acceptance matches when it is calibrated
        (`benchmarks/tree_calibration.py`)."""
        tree, edges = self.tree, torch.zeros(len(self.tree), device=self.tree.tokens.device)
        for nodes, logprobs, support in self.expansions:  # one gather per expansion call, no per-node work
            row = torch.full_like(tree.parents, -1)
            row[nodes] = torch.arange(len(nodes), device=nodes.device)
            mine = row[tree.parents.clamp(min=0)]
            rows = mine.clamp(min=0)  # each node's row: its parent's child distribution
            if support is None:
                logp = logprobs[rows, tree.tokens]
            else:
                logp = logprobs[rows].masked_fill(support[rows] != tree.tokens[:, None], 0.0).sum(1)
            edges = torch.where((tree.parents >= 0) & (mine >= 0), logp.float(), edges)
        return edges.exp()

    def path_probs(self) -> torch.Tensor:
        """(T,) the product of the edge probabilities from the anchor to each node: with calibrated draft
        probabilities, the chance that greedy acceptance walks through the node (docs/results.md: per-step budgets)."""
        edges = self.edge_probs().clamp(min=1e-30).log()
        return (self.tree.ancestors.to(edges.dtype) @ edges).exp()

    def first(self, n: int) -> "Proposal":
        """The proposal cut to its first n draft nodes: nodes are best first, so this is the tree of budget n
        (a parent precedes its children); expansions of the nodes cut off are dropped."""
        tree = self.tree
        if n + 1 >= len(tree):
            return self
        # contiguous copies: a compiled verify guards on strides, and a view of the larger matrix would recompile
        cut = Tree.with_ancestors(tree.tokens[: n + 1].clone(), tree.parents[: n + 1].clone(),
                                  tree.ancestors[: n + 1, : n + 1].contiguous())
        kept = [(nodes[nodes <= n], logprobs[nodes <= n], None if support is None else support[nodes <= n])
                for nodes, logprobs, support in self.expansions]
        return Proposal(cut, [e for e in kept if len(e[0])], self.vocab_size, self.fixed)


def without_fixed(logprobs: torch.Tensor, fixed: int) -> torch.Tensor:
    """(n, K) log-probs of the distribution each row's drawn children come from: the row without its `fixed`
    most probable entries, renormalised (rows with no mass left: all -inf)."""
    if fixed == 0:
        return logprobs
    rest = logprobs.scatter(-1, logprobs.topk(min(fixed, logprobs.shape[-1]), dim=-1).indices, -math.inf)
    return rest - rest.logsumexp(-1, keepdim=True).clamp_min(-1e30)  # -inf rows stay -inf, not NaN


def ranked_children(logprobs: torch.Tensor, width: int, generator: torch.Generator | None,
                    fixed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, log mass), each (n, w): the support indices of each row's first w children and the log of the
    mass each child's slot takes (greedy: its probability; sampled: the mass still undrawn before it, the
    `fixed` most probable children first, taken in order of probability, then draws from the rest)."""
    w = min(width, logprobs.shape[-1])
    if generator is None:
        logp, order = logprobs.topk(w, dim=-1)
        return order, logp
    uniform = torch.rand(logprobs.shape, generator=generator, device=generator.device).to(logprobs.device)
    keys = logprobs - (-uniform.log()).log()  # Gumbel-top-k
    if fixed:  # the fixed children in order of probability, then draws from the rest
        top = logprobs.topk(min(fixed, logprobs.shape[-1]), dim=-1).indices
        rest = keys.scatter(-1, top, -math.inf).topk(max(w - top.shape[-1], 0), dim=-1).indices
        order = torch.cat([top, rest], -1)[:, :w]
    else:
        order = keys.topk(w, dim=-1).indices
    drawn = logprobs.gather(1, order).exp()
    undrawn = logprobs.exp().sum(-1, keepdim=True) - (drawn.cumsum(-1) - drawn)
    return order, torch.where((undrawn > 1e-12) & (drawn > 0), undrawn.clamp_min(1e-12).log(), -math.inf)


class Slots:
    """Every expanded node's children not yet in the tree: (node, k) -> priority, token, and the child's
    share of the path score (its log-prob, or with an `AcceptanceTable` its estimated log-reach)."""

    def __init__(self, capacity: int, width: int, device: torch.device | str):
        self.priority = torch.full((capacity, width), -math.inf, device=device)
        self.tokens = torch.zeros(capacity, width, dtype=torch.long, device=device)
        self.gains = torch.zeros(capacity, width, device=device)

    def fill(self, nodes: torch.Tensor, priority: torch.Tensor, tokens: torch.Tensor, gains: torch.Tensor) -> None:
        w = priority.shape[1]
        self.priority[nodes, :w], self.tokens[nodes, :w], self.gains[nodes, :w] = priority, tokens, gains

    def take_best(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents, tokens, score gains) of the n best slots (fewer when fewer are left), best first."""
        flat = self.priority.view(-1)
        values, index = flat.topk(min(n, len(flat)))
        index = index[values > -math.inf]
        flat[index] = -math.inf
        node, k = index // self.priority.shape[1], index % self.priority.shape[1]
        return node, self.tokens[node, k], self.gains[node, k]


def best_first_tree(
    anchor: int, budget: int, max_depth: int, child_logprobs: ChildLogProbs, width: int,
    nodes_per_call: int | Callable[[int], int] = 1, generator: torch.Generator | None = None,
    vocab_size: int | None = None, priority: AcceptanceTable | None = None, fixed: int = 0, *,
    device: torch.device | str,
) -> Proposal:
    """The tree of at most `budget` draft nodes below `anchor` (node 0), nodes in the order taken.

    generator None: greedy (k-best) order; otherwise children are drawn without replacement, after each node's
    `fixed` most probable ones (taken as they are).
    nodes_per_call: nodes per expansion wave, or a function of the tree's size so far (a schedule that does
    not depend on the budget keeps the budget-b tree equal to the first b nodes of any larger one).
    vocab_size: needed when `child_logprobs` returns supports rather than vocabulary rows.
    priority: sampled trees score a child by this table's estimated log-reach instead of its draft mass.
    device: where the tree and the search live (the target's).
    """
    grown, slots = Grown.start(anchor, budget + 1, device), Slots(budget + 1, width, device)
    expansions = []

    def expand(nodes: torch.Tensor) -> None:
        nodes = nodes[grown.depths[nodes] < max_depth]
        if len(nodes) == 0:
            return
        out = child_logprobs(nodes, grown)
        logprobs, support = (out, None) if isinstance(out, torch.Tensor) else out
        if support is not None and vocab_size is None:
            raise WeaverError("best_first_tree needs vocab_size when child_logprobs returns token supports")
        logprobs = logprobs.float()
        order, log_mass = ranked_children(logprobs, width, generator, fixed)
        tokens = order if support is None else support.gather(1, order)
        gains = logprobs.gather(1, order)
        if priority is not None and generator is not None:
            reach = priority.child_log_reach(grown.depths[nodes] + 1, logprobs.max(-1).values.exp(), order.shape[1])
            log_mass = gains = torch.where(log_mass > -math.inf, reach, -math.inf)
        slots.fill(nodes, grown.scores[nodes, None] + log_mass, tokens, gains)
        expansions.append((nodes, logprobs, support))

    expand(torch.zeros(1, dtype=torch.long, device=device))
    while grown.size <= budget:
        per_call = nodes_per_call(grown.size) if callable(nodes_per_call) else nodes_per_call
        parents, tokens, gains = slots.take_best(min(per_call, budget + 1 - grown.size))
        if len(parents) == 0:
            break
        new = grown.add(parents, tokens, gains)
        if grown.size <= budget:
            expand(new)
    return Proposal(grown.tree(), expansions, vocab_size, fixed if generator is not None else 0)


def best_first_reference(
    anchor: int, budget: int, max_depth: int, child_logprobs: ChildLogProbs, width: int,
    nodes_per_call: int | Callable[[int], int] = 1, generator: torch.Generator | None = None,
    vocab_size: int | None = None, priority: AcceptanceTable | None = None, fixed: int = 0, *,
    device: torch.device | str,
) -> Proposal:
    """`best_first_tree` written plainly: a heap of slots popped one at a time, each sampled child drawn
    by its own `torch.multinomial`. Greedy trees equal the fast search's, and so do the shapes of calibrated
    sampled trees whose child distributions depend on depth only (tests/test_builders.py)."""
    grown = Grown.start(anchor, budget + 1, device)
    heap: list[tuple[float, int, int]] = []  # (-priority, tie-break, node whose next child this slot is)
    tie_break = itertools.count()
    children: dict[int, _Children] = {}
    expansions = []

    def push_slot(node: int) -> None:
        log_mass = children[node].next_log_mass()
        if log_mass is not None and log_mass > -math.inf:
            heapq.heappush(heap, (-(float(grown.scores[node]) + log_mass), next(tie_break), node))

    def expand(nodes: list[int]) -> None:
        nodes = [n for n in nodes if int(grown.depths[n]) < max_depth]
        if not nodes:
            return
        ids = torch.tensor(nodes, device=device)
        out = child_logprobs(ids, grown)
        logprobs, support = (out, None) if isinstance(out, torch.Tensor) else out
        expansions.append((ids, logprobs.float(), support))
        for j, n in enumerate(nodes):
            reach = None
            if priority is not None and generator is not None:
                confidence = logprobs[j].float().max().exp()[None]
                reach = priority.child_log_reach(grown.depths[n][None] + 1, confidence, width)[0].cpu()
            children[n] = _Children(logprobs[j].float().cpu(), None if support is None else support[j].cpu(),
                                    width, generator, reach, fixed)
            push_slot(n)

    expand([0])
    while heap and grown.size <= budget:
        new: list[int] = []
        per_call = nodes_per_call(grown.size) if callable(nodes_per_call) else nodes_per_call
        while heap and len(new) < per_call and grown.size <= budget:
            _, _, parent = heapq.heappop(heap)
            token, gain = children[parent].take()
            new.append(grown.size)
            grown.add(torch.tensor([parent], device=device), torch.tensor([token], device=device),
                      torch.tensor([gain], device=device))
            push_slot(parent)
        if grown.size <= budget:
            expand(new)
    return Proposal(grown.tree(), expansions, vocab_size, fixed if generator is not None else 0)


class _Children:
    """The children of one expanded node, one at a time: in order of probability, or drawn without
    replacement from the node's distribution over its support after its `fixed` most probable ones; `reach`:
    the calibrated log-reach of each rank (sampled trees with an `AcceptanceTable`)."""

    def __init__(self, logprobs: torch.Tensor, support: torch.Tensor | None, width: int,
                 generator: torch.Generator | None, reach: torch.Tensor | None = None, fixed: int = 0):
        self.logprobs, self.support, self.generator, self.reach = logprobs, support, generator, reach
        self.width, self.taken = min(width, len(logprobs)), 0
        self.ranked = logprobs.argsort(descending=True)
        top = logprobs.topk(min(fixed, len(logprobs))).indices if generator is not None else self.ranked[:0]
        self.fixed = top[logprobs[top] > -math.inf]  # a fixed child of probability 0 is never taken (as in the waves)
        self.undrawn = logprobs.exp()

    def next_log_mass(self) -> float | None:
        """Log of the mass the next child takes (greedy: its probability; sampled: the undrawn mass, or
        its calibrated log-reach)."""
        if self.taken >= self.width:
            return None
        if self.generator is None:
            return float(self.logprobs[self.ranked[self.taken]])
        mass = float(self.undrawn.sum())
        if mass <= 1e-12:
            return None
        return math.log(mass) if self.reach is None else float(self.reach[self.taken])

    def take(self) -> tuple[int, float]:
        """(token, share of the path score) of the next child: its log-prob, or its calibrated log-reach."""
        if self.generator is None:
            index = int(self.ranked[self.taken])
        elif self.taken < len(self.fixed):
            index = int(self.fixed[self.taken])
            self.undrawn[index] = 0.0
        else:
            index = int(torch.multinomial(self.undrawn, 1, generator=self.generator))
            self.undrawn[index] = 0.0
        gain = float(self.logprobs[index]) if self.reach is None else float(self.reach[self.taken])
        self.taken += 1
        return (index if self.support is None else int(self.support[index])), gain
