"""Acceptance rules: which drafted tokens the target keeps, and the bonus token it adds.

Every rule is lossless: greedy output equals the target's greedy output, and sampled output has exactly
the target's distribution. For a chain, node i's target logits (from `TargetModel.verify`) are the
target's distribution for the token after node i, given the committed context and nodes 0..i.
"""

from __future__ import annotations

import torch

from weaver.tree import Tree


def greedy_tree(tree: Tree, target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted leaf node, bonus token): from the anchor (node 0), follow the child holding the target's
    argmax while there is one; the target's argmax at the last node reached is the bonus."""
    choice = target_logits.argmax(-1).tolist()
    node = 0
    while True:
        child = tree.child(node, choice[node])
        if child is None:
            return node, choice[node]
        node = child


def target_only_tree(
    tree: Tree, target_logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """(accepted leaf node, next token) for sampling on any tree, using the target alone: at each node draw
    x ~ p(. | path) and move to the child holding x; the first x with no such child is emitted.

    Every emitted token is a draw from the target's conditional, so the output is exactly the target's
    distribution whatever the tree; the draft probabilities are not used.
    """
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    node = 0
    while True:
        x = int(torch.multinomial(p[node], 1, generator=generator))
        child = tree.child(node, x)
        if child is None:
            return node, x
        node = child


def greedy_chain(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """(accepted drafts, bonus token) for the chain [anchor, d_1 .. d_{T-1}]: greedy_tree on a chain."""
    return greedy_tree(Tree.chain(torch.cat([drafts.new_zeros(1), drafts])), target_logits)


def speculative_sampling_chain(
    target_logits: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor, temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al.; Chen et al.) along a chain of drafts d_i ~ q_i.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token from the
    residual max(p_i - q_i, 0), normalised; if all are accepted emit a bonus token from p_T.
    Lossless for any proposal q_i that may depend on the context and d_<i, so factorized marginals qualify.
    """
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    u = torch.rand(len(drafts), generator=generator, device=p.device)
    for i, d in enumerate(drafts.tolist()):
        if u[i] * draft_probs[i, d] <= p[i, d]:
            continue
        residual = (p[i] - draft_probs[i]).clamp_min(0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))
