"""Our draft trees as SGLang's tree-verify inputs, and accepted paths between SGLang's verify outputs and ours.

SGLang's EAGLE tree verify (`EagleVerifyInput`, `verify_tree_greedy_func`) takes, per request, n draft
tokens whose node 0 is the last verified token (our anchor), positions `seq_len + depth`, an attention mask
over ancestors, and the tree as linked lists in node-index order: `retrieve_next_token[i]` is i's first
child, `retrieve_next_sibling[i]` its next sibling, -1 ends a list, and `retrieve_index[b, i] = b * n + i`.
n is fixed per batch: a smaller tree is padded with nodes that hang off the root in the mask but sit in no
list, so verification never visits them (GDN layers read the same padded trees as parent pointers,
`weaver.serving.sglang.gdn`). Only torch here: the conversion is tested against SGLang's own
tree builder and greedy verify (tests/serving_sglang) and needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from weaver.errors import WeaverError
from weaver.tree import Tree


@dataclass(frozen=True)
class TreeVerifyInputs:
    """One batch's trees in SGLang's layout (field names as in `EagleVerifyInput`)."""

    draft_token: torch.Tensor  # (bs * n,) long
    positions: torch.Tensor  # (bs * n,) long: seq_len + depth
    custom_mask: torch.Tensor  # bool; full: request b's n rows over seq_len_b + n columns, else (bs * n * n,)
    retrieve_index: torch.Tensor  # (bs, n) long
    retrieve_next_token: torch.Tensor  # (bs, n) long
    retrieve_next_sibling: torch.Tensor  # (bs, n) long
    parents: torch.Tensor  # (bs * n,) long: the padded trees as node-local parent pointers (GDN layers' verify)

    @property
    def draft_token_num(self) -> int:
        return self.retrieve_index.shape[1]


def tree_verify_inputs(
    trees: Sequence[Tree], seq_lens: torch.Tensor, draft_token_num: int | None = None, full_mask: bool = True
) -> TreeVerifyInputs:
    """SGLang's verify inputs for one tree per request. seq_lens: (bs,) committed tokens before each anchor;
    draft_token_num: n, at least the largest tree (default: exactly that); full_mask: SGLang's FULL_MASK
    layout (GPU backends) with the committed prefix's columns, else QLEN_ONLY (the tree part only)."""
    if len(trees) == 0 or len(trees) != len(seq_lens):
        raise WeaverError(f"need one tree per request: {len(trees)} trees for {len(seq_lens)} sequence lengths")
    n = draft_token_num or max(len(tree) for tree in trees)
    if n < max(len(tree) for tree in trees):
        raise WeaverError(f"draft_token_num={n} is smaller than a tree of {max(len(t) for t in trees)} nodes")
    padded = [_padded(tree, n) for tree in trees]
    first, sibling = zip(*(_linked_lists(tree.parents, n) for tree in trees))
    offsets = torch.arange(len(trees), device=seq_lens.device)[:, None] * n
    rows = [tree.ancestors for tree in padded]
    if full_mask:
        rows = [torch.cat([row.new_ones(n, int(s)), row], dim=1) for row, s in zip(rows, seq_lens.tolist())]
    return TreeVerifyInputs(
        draft_token=torch.cat([tree.tokens for tree in padded]),
        positions=(seq_lens[:, None] + torch.stack([tree.depth for tree in padded])).flatten(),
        custom_mask=torch.cat([row.flatten() for row in rows]),
        retrieve_index=offsets + torch.arange(n, device=seq_lens.device),
        retrieve_next_token=torch.stack(first),
        retrieve_next_sibling=torch.stack(sibling),
        parents=torch.cat([tree.parents for tree in padded]),
    )


def accepted_leaves(
    accept_index: torch.Tensor, accept_token_num: torch.Tensor, predicts: torch.Tensor
) -> list[tuple[int, int]]:
    """(accepted leaf node, bonus token) per request, as `weaver.acceptance.greedy_tree` returns them, from
    SGLang's greedy verify outputs: accept_index (bs, levels) global node ids along the accepted path (root
    first), accept_token_num (bs,) accepted drafts without the bonus, predicts (bs * n,) node-indexed."""
    n = len(predicts) // len(accept_index)
    last = accept_index.gather(1, accept_token_num.long()[:, None]).squeeze(1).long()
    return [(leaf - b * n, bonus) for b, (leaf, bonus) in enumerate(zip(last.tolist(), predicts[last].tolist()))]


def accept_outputs(
    trees: Sequence[Tree], leaves: Sequence[tuple[int, int]], draft_token_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `accepted_leaves`: (predicts, accept_index, accept_token_num) exactly as SGLang's greedy
    verify writes them, for (leaf, bonus) pairs any of `weaver.acceptance`'s rules chose (sampling has no SGLang
    verify on most devices), so SGLang's commit of accepted KV and states can consume them."""
    n, device = draft_token_num, trees[0].tokens.device
    predicts = torch.zeros(len(trees) * n, dtype=torch.int32, device=device)
    accept_index = torch.full((len(trees), n), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(len(trees), dtype=torch.int32, device=device)
    for b, (tree, (leaf, bonus)) in enumerate(zip(trees, leaves)):
        path = tree.path_to(leaf)
        predicts[b * n + path[:-1]] = tree.tokens[path[1:]].int()  # each accepted node predicted its child
        predicts[b * n + leaf] = bonus
        accept_index[b, :len(path)] = (b * n + path).int()
        accept_token_num[b] = len(path) - 1
    return predicts, accept_index, accept_token_num


def _single_root(tree: Tree) -> None:
    if int(tree.parents[0]) != -1 or bool((tree.parents[1:] < 0).any()):
        raise WeaverError("SGLang's tree verify needs one root: node 0 (the anchor) with every other node below it")


def _padded(tree: Tree, n: int) -> Tree:
    """The tree with n - len(tree) extra nodes: copies of the root token, children of the root."""
    _single_root(tree)
    extra = n - len(tree)
    if extra == 0:
        return tree
    return Tree(torch.cat([tree.tokens, tree.tokens[:1].expand(extra)]),
                torch.cat([tree.parents, tree.parents.new_zeros(extra)]))


def _linked_lists(parents: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first child, next sibling) of every node, -1 for none; siblings in node-index order."""
    first, sibling = parents.new_full((n,), -1), parents.new_full((n,), -1)
    parent = parents[1:]
    order = torch.argsort(parent, stable=True)  # grouped by parent, index order within a group
    child, parent = order + 1, parent[order]
    same = parent[1:] == parent[:-1]
    sibling[child[:-1][same]] = child[1:][same]
    heads = torch.cat([same.new_ones(min(1, len(parent))), ~same])
    first[parent[heads]] = child[heads]
    return first, sibling
