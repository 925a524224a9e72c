"""Acceptance rules: which drafted tokens the target keeps, and the bonus token it adds.

Every rule is lossless: greedy output equals the target's greedy output, and sampled output has exactly
the target's distribution. For a chain, node i's target logits (from `TargetModel.verify`) are the
target's distribution for the token after node i, given the committed context and nodes 0..i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weaver.errors import WeaverError
from weaver.tree import Tree

if TYPE_CHECKING:
    from weaver.search import Proposal

Observer = Callable[[int, int, float], None]  # (node, child rank, probability the rule accepts a child drawn there)


def check_finite(
    values: torch.Tensor, what: str, where: str, nan_only: bool = False,
    computed_in: torch.dtype | None = None, setting: str = "model.dtype",
) -> None:
    """Refuse NaN/inf (with nan_only: NaN) in logits an acceptance rule is about to read: argmax and
    softmax would turn them into a wrong token without a word. `computed_in`: the dtype of the model that
    made them when they were cast since (a bf16 drafter's logits reach us in the target's dtype), whose
    `setting` the error suggests changing.

    Cost: one sum over a tensor already computed and one host sync (the acceptance rules sync anyway). Any
    NaN/inf element makes the sum non-finite, so a finite sum proves the tensor finite. A non-finite sum (a bad
    element, or an overflowing sum: every draft from a reduced draft vocabulary, whose other tokens hold the
    lowest finite logit) is settled by the extremes, one more pass (NaN propagates into both; finite extremes
    prove every element finite), not by element-wise masks, which cost a CPU ~20x the sum (0.9 ms a SmolLM2
    draft of 8 x 49,152 logits)."""
    total = values.sum()
    if bool(torch.isnan(total) if nan_only else ~torch.isfinite(total)):
        low, high = torch.aminmax(values)
        nan = bool(torch.isnan(low))
        if nan or (not nan_only and not bool(torch.isfinite(low) & torch.isfinite(high))):
            dtype = computed_in or values.dtype
            hint = ("the model's weights or activations are not finite" if dtype in (torch.float32, torch.float64)
                    else f"an overflow in {str(dtype).removeprefix('torch.')} or broken weights: try {setting}=float32")
            raise WeaverError(f"{what} contain {'NaN' if nan else 'inf'} {where}: {hint}")


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (the first maximal index, as documented for both) read from `max`, which a CPU runs about 4x
    faster: 48 against 189 us for one row of SmolLM2's 49,152 bf16 logits, 0.2 against 0.9 ms for a 9-node verify's."""
    return logits.max(-1).indices


def greedy_tree(tree: Tree, target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted leaf node, bonus token): from the anchor (node 0), follow the child holding the target's
    argmax while there is one; the target's argmax at the last node reached is the bonus."""
    choice = argmax(target_logits).tolist()
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


def recursive_rejection_tree(
    tree: Tree, target_logits: torch.Tensor, child_probs: dict[int, torch.Tensor], temperature: float,
    generator: torch.Generator | None = None, observe: Observer | None = None,
) -> tuple[int, int]:
    """(accepted leaf node, next token): recursive rejection sampling over siblings (SpecInfer, SpecTr),
    for trees whose children c_1, c_2, ... of a node were drawn in that order without replacement from
    q = child_probs[node] (`weaver.builders` with a generator).

    At a node, with p the target's distribution: accept c_i with probability min(1, p(c_i) / q(c_i)) and
    move to it; on rejection p <- normalised max(p - q, 0) and q <- q without c_i, renormalised (each
    step is one speculative-sampling step of p against q, so the emitted token is distributed as p);
    when every child is rejected, draw the token from the last p. On a chain this is standard speculative
    sampling, the bonus token included. A child of draft probability 0 was not drawn but fixed (`fixed_children`:
    q was the node's distribution without the fixed tokens, so the residual keeps all their target mass): it is
    skipped, and reached when the final draw lands on it, which makes the node accept p(fixed) on top of what
    the drawn children accept. A rejected drawn child cannot be drawn again (its residual is 0), so with no
    fixed children this is plain recursive rejection sampling. observe(node, rank, h) hears, at each drawn child
    considered, the probability h = sum_x min(p(x), q(x)) that a child drawn at that point is accepted
    (`weaver.calibration`).
    """
    probs = torch.softmax(target_logits.float() / temperature, dim=-1)
    node = 0
    while True:
        p, q = probs[node], child_probs.get(node)
        children = tree.children(node)
        drawn = [c for c in children if q is not None and float(q[int(tree.tokens[c])]) > 0]
        for rank, child in enumerate(drawn):
            if observe is not None:
                observe(node, rank, float(torch.minimum(p, q).sum()))
            x = int(tree.tokens[child])
            if float(torch.rand((), generator=generator)) * float(q[x]) <= float(p[x]):
                node = child
                break
            residual = (p - q).clamp_min(0)
            p = residual / residual.sum() if residual.sum() > 0 else p  # p == q: the rejection had probability 0
            q = q.clone()
            q[x] = 0.0
            q = q / q.sum() if q.sum() > 0 else q
        else:
            token = int(torch.multinomial(p, 1, generator=generator))
            fixed = [c for c in children if c not in drawn and int(tree.tokens[c]) == token]
            if not fixed:
                return node, token
            node = fixed[0]


def traversal_tree(
    tree: Tree, target_logits: torch.Tensor, child_probs: dict[int, torch.Tensor], temperature: float,
    generator: torch.Generator | None = None, observe: Observer | None = None,
) -> tuple[int, int]:
    """(accepted leaf node, next token): traversal verification (Weng et al., 2025), which on a chain is the block
    verification of Sun et al. (2024), for the trees `recursive_rejection_tree` verifies (children drawn in order
    without replacement from q = child_probs[node]).

    Recursive rejection sampling settles a node before looking below it; traversal weighs whole paths, deepest
    first. A node x under a parent of weight w gets weight min(1, w p(x) / q(x)), a sequence-level acceptance
    probability: a child the target likes more than the draft did (p / q > 1) makes up for its parent's low ratio.
    A node tries its children's subtrees in draw order, then, left a leaf, is accepted with probability w and emits
    a token from p. When a child's subtree rejects, the parent keeps what is still to be produced:
    p <- max(w p - q, 0) / rho and w <- rho / (rho + 1 - w) with rho = sum(max(w p - q, 0)) (both independent of
    the child drawn), and q loses the child. Lossless by induction from the leaves: a node of weight w emits x as
    its next token with probability w p(x) over the draws below it, and is rejected with probability 1 - w
    (docs/method.md §2.5). The root's weight stays 1, so a step always emits. observe(node, rank, h) hears, at each
    child considered, the probability h = sum(min(w p, q)) that a child drawn there carries the walk.
    """
    # w p in float64: a deep node's weight is a product of many ratios, and in float32 w p turns subnormal (slow)
    probs = torch.softmax(target_logits.float() / temperature, dim=-1).double()

    def settle(node: int, weight: float) -> tuple[int, int] | None:
        p, q = probs[node], child_probs.get(node)  # both normalised throughout
        for rank, child in enumerate(tree.children(node)):
            x = int(tree.tokens[child])
            px, qx = float(p[x]), float(q[x])
            if qx == 0:
                raise WeaverError("traversal verification settles drawn children only; a tree with fixed children "
                                  "(fixed_children > 0) needs sampling 'rrs'")
            residual = (p * weight).sub_(q).clamp_min_(0)  # what the target still owes if this subtree rejects
            rho = float(residual.sum())
            if observe is not None:
                observe(node, rank, weight - rho)  # sum(min(w p, q)) = w - rho
            if (found := settle(child, min(1.0, weight * px / qx))) is not None:
                return found
            rejected = rho + 1.0 - weight  # sum(max(q - w p, 0)): the chance a subtree drawn here rejects
            if rho > 0:  # rho == 0 leaves weight 0 (not for the root: there rho == rejected)
                p = residual.div_(rho)
            if node and rejected > 0:  # the root keeps weight 1 (rho == rejected there)
                weight = min(1.0, rho / rejected)
            q = q / (1.0 - qx) if qx < 1.0 else q.clone()  # drawn without replacement
            q[x] = 0.0
        if node == 0 or float(torch.rand((), generator=generator)) < weight:
            return node, int(torch.multinomial(p, 1, generator=generator))
        return None

    return settle(0, 1.0)


@dataclass(frozen=True)
class SamplingRule:
    """A lossless acceptance rule for temperature > 0: accept(tree, target logits, the step's Proposal,
    temperature, generator, observer or None) -> (leaf, next token); `draws_trees`: the builders draw the
    tree's children without replacement from the draft distributions (else they build the greedy tree) and
    the rule reports its per-child acceptance probabilities to an observer (`weaver.calibration`)."""

    accept: Callable[[Tree, torch.Tensor, Proposal, float, torch.Generator | None, Observer | None], tuple[int, int]]
    draws_trees: bool


# To add a rule: one entry here (`eval.sampling` and `speculative_generate(sampling=...)` read this table).
SAMPLING_RULES: dict[str, SamplingRule] = {
    "rrs": SamplingRule(lambda tree, logits, proposal, temperature, generator, observe: recursive_rejection_tree(
        tree, logits, proposal.child_probs, temperature, generator, observe), draws_trees=True),
    "traversal": SamplingRule(lambda tree, logits, proposal, temperature, generator, observe: traversal_tree(
        tree, logits, proposal.child_probs, temperature, generator, observe), draws_trees=True),
    "target_only": SamplingRule(lambda tree, logits, proposal, temperature, generator, observe: target_only_tree(
        tree, logits, temperature, generator), draws_trees=False),
}
DRAWN_TREE_RULES = [name for name, rule in SAMPLING_RULES.items() if rule.draws_trees]  # what a tree-drawing server takes
