"""Draft trees: nodes in topological order (parents before children) and what verification derives.

Node 0..T-1; `parents[i]` is the parent node, or -1 when the parent is the last committed token.
A chain (DFlash) is the tree whose parents are -1, 0, 1, ..., T-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from weaver.errors import WeaverError


@dataclass(frozen=True, eq=False)
class Tree:
    tokens: torch.Tensor  # (T,) long
    parents: torch.Tensor  # (T,) long, -1 for children of the committed context

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1 or len(self.tokens) == 0:
            raise WeaverError("a tree needs matching non-empty 1-d tokens and parents")
        if bool((self.parents >= torch.arange(len(self.parents), device=self.parents.device)).any()):
            raise WeaverError("tree nodes must be in topological order (parent index < node index)")

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "Tree":
        n, device = len(tokens), tokens.device
        return cls.with_ancestors(tokens, torch.arange(-1, n - 1, device=device),
                                  torch.ones(n, n, dtype=torch.bool, device=device).tril())

    @classmethod
    def with_ancestors(cls, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor) -> "Tree":
        """A tree whose ancestor matrix its builder already holds (the search grows it node by node)."""
        tree = cls(tokens, parents)
        tree.__dict__["ancestors"] = ancestors  # fills the cached property
        return tree

    def padded(self, size: int) -> "Tree":
        """This tree plus `size - len(self)` nodes of token 0 hanging off the committed context, last: static
        shapes for a compiled verify. They are nobody's ancestor, so no real node's output changes."""
        extra = size - len(self)
        if extra <= 0:
            return self
        tokens = torch.cat([self.tokens, self.tokens.new_zeros(extra)])
        parents = torch.cat([self.parents, self.parents.new_full((extra,), -1)])
        ancestors = torch.eye(size, dtype=torch.bool, device=self.tokens.device)
        ancestors[: len(self), : len(self)] = self.ancestors
        return Tree.with_ancestors(tokens, parents, ancestors)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """(T, T) bool: [i, j] when node j is an ancestor of node i or i itself."""
        return ancestor_matrix(self.parents)

    @cached_property
    def depth(self) -> torch.Tensor:
        """(T,) 0 for children of the committed context; position id = next position + depth."""
        return self.ancestors.sum(-1) - 1

    @cached_property
    def _children(self) -> dict[tuple[int, int], int]:
        """(parent node, token) -> child node (the first, should a token repeat among siblings)."""
        children: dict[tuple[int, int], int] = {}
        for node, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            children.setdefault((parent, token), node)
        return children

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` that holds `token`, if any."""
        return self._children.get((node, token))

    @cached_property
    def _child_lists(self) -> list[list[int]]:
        lists: list[list[int]] = [[] for _ in range(len(self))]
        for node, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                lists[parent].append(node)
        return lists

    def children(self, node: int) -> list[int]:
        """The children of `node` in index order (for sampled trees: the order they were drawn in)."""
        return self._child_lists[node]

    def path_to(self, leaf: int) -> torch.Tensor:
        """Root-to-leaf node indices (ascending = topological order)."""
        return self.ancestors[leaf].nonzero().squeeze(-1)


def ancestor_matrix(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """(T, T) bool ancestors-or-self of the tree `parents` (T,) describes, one level per pass.

    max_depth: the tree is at most this deep: that many passes, tensor ops only (no host sync, so
    torch.compile traces it whole); None: passes until every node's chain has reached the root."""
    T = len(parents)
    rows = torch.arange(T, device=parents.device)
    anc = torch.eye(T, dtype=torch.bool, device=parents.device)
    up = parents
    for _ in range(T if max_depth is None else max_depth):
        has = up >= 0
        if max_depth is None and not bool(has.any()):
            break
        anc[rows, up.clamp(min=0)] |= has
        up = torch.where(has, parents[up.clamp(min=0)], up)
    return anc
