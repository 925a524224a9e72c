"""Tree builders: from per-node child distributions to a draft tree under a node budget (docs/method.md §2.4).

Every builder returns a `weaver.search.Proposal`: a `Tree` whose node 0 is the anchor (the last committed
token) and whose other nodes, at most `budget` of them, are draft tokens in topological order, plus the
distribution each expanded node's children were taken from (what draft-aware acceptance needs).

All builders are one best-first search (`weaver.search.best_first_tree`) and differ in the child
distributions. Under the factorized marginals the search's tree has a direct form, built in a few tensor
ops instead of one wave per node and tested equal to the search (the chain, greedy DDTree):

- chain: the drafter's per-depth marginals, one child per node (DFlash): the per-depth argmax or draw.
- ddtree: the same marginals, up to `width` children per node: path score = sum of log-marginals
  (greedy: `best_paths`, a beam per depth).
- weaver: the adapter's conditional distribution given the path (`weaver.models.adapter`).
- oracle: the target's own conditionals (verifying the tree grown so far): not deployable, it is
  the τ ceiling for a budget.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weaver.acceptance import argmax
from weaver.errors import WeaverError
from weaver.models.adapter import AdapterCache, WeaverAdapter, draft_pools, expansion_batch
from weaver.models.compile import Compile
from weaver.models.drafter import Draft, in_vocab, proposable
from weaver.models.linear import exact_bf16
from weaver.search import ChildLogProbs, Grown, Proposal, best_first_tree
from weaver.static_trees import best_paths_nodes, kept_parents, rescorer
from weaver.tree import Tree

if TYPE_CHECKING:
    from weaver.calibration import AcceptanceTable
    from weaver.models.cache import ModelCache
    from weaver.models.target import TargetModel


@dataclass(frozen=True)
class StepInputs:
    """What one step's tree builders may read."""

    anchor: int  # the last committed token: node 0 of the tree
    draft: Draft  # the drafter's block (batch row 0 is used)
    target_hidden: torch.Tensor  # (H,) target's final-norm state of the token before the anchor
    target: TargetModel  # (or what stands in for it: its embedding, lm_head and sizes; the Weaver adapter reads them)
    cache: ModelCache | None = None  # the target's committed cache (only the oracle reads it: it verifies paths)
    adapter: WeaverAdapter | None = None  # the Weaver adapter (method weaver)


DEFAULT_CHILDREN = 8  # the Weaver search's children per node when none is given (at most the adapter's pool)


@dataclass(frozen=True)
class SearchConfig:
    """How a step's tree is grown: `budget` draft nodes; children drawn without replacement when a generator
    is given, else greedy; `children` per node of the Weaver search (`weaver.search.children`); `nodes_per_call` nodes the Weaver
    and oracle searches expand per adapter / target call (default ceil(budget / 16), or with `anytime`
    ceil(tree size so far / 16), so that any budget's tree is a prefix of a larger one's: `budget: auto`);
    `compiled`: the Weaver search's adapter step through torch.compile (`weaver.models.compile`); `priority`: sampled trees rank nodes
    by this table's estimated acceptance (`weaver.calibration`) instead of draft probability; `fixed_children`:
    sampled trees take each node's that many most probable children as they are and draw the rest from the
    mass outside them (`weaver.search`; recursive rejection sampling reaches them by its residual draw)."""

    budget: int
    children: int = DEFAULT_CHILDREN
    nodes_per_call: int | None = None
    generator: torch.Generator | None = None
    temperature: float = 1.0
    compiled: Compile = False
    anytime: bool = False
    priority: AcceptanceTable | None = None
    rescore: int | None = None
    fixed_children: int = 0

    def per_call(self) -> int | Callable[[int], int]:
        return self.nodes_per_call or (expansion_batch if self.anytime else expansion_batch(self.budget))


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
                  generator: torch.Generator | None, temperature: float,
                  priority: AcceptanceTable | None = None, fixed: int = 0) -> Proposal:
    """Best-first over the factorized marginals draft_logits (D, V): depth d scores use row d - 1."""
    child_logprobs = marginal_logprobs(draft_logits, temperature, None if generator else width)
    return best_first_tree(anchor, budget, len(draft_logits), child_logprobs, width, generator=generator,
                           vocab_size=draft_logits.shape[-1], priority=priority, fixed=fixed, device=draft_logits.device)


def support_of(vocab: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The support of `rows` log-prob rows over `proposable`'s columns (the draft vocabulary `vocab`), as a
    `Proposal` expansion lists it."""
    return None if vocab is None else vocab.expand(rows, -1)


def chain_tree(anchor: int, draft_logits: torch.Tensor, budget: int, generator: torch.Generator | None = None,
               temperature: float = 1.0, vocab: torch.Tensor | None = None, fixed: int = 0) -> Proposal:
    """DFlash's chain: the argmax (or one Gumbel-max draw) per depth, `budget` drafts at most, in one shot:
    with one child per node the best-first search (`marginal_tree` with width 1, tested equal) is exactly
    the per-depth choice, and its one wave per node cost 10-12% of a tiny-target step. vocab: the drafter's
    draft vocabulary (`proposable`). Sampled with `fixed` > 0: the most probable token per depth, as a fixed
    child (`weaver.search.ranked_children`'s choice of it)."""
    n = min(budget, len(draft_logits))
    log_marginals = (proposable(draft_logits[:n], vocab).float() / temperature).log_softmax(-1)
    if generator is not None and fixed:
        drafts = log_marginals.topk(1, dim=-1).indices[:, 0]  # the token `Proposal.child_probs` leaves out
    elif generator is not None:
        uniform = torch.rand(log_marginals.shape, generator=generator, device=generator.device).to(log_marginals.device)
        drafts = argmax(log_marginals - (-uniform.log()).log())
    else:
        drafts = argmax(log_marginals)
    nodes = torch.arange(n, device=draft_logits.device)  # node i (depth i) is expanded by row i
    return Proposal(Tree.chain(torch.cat([drafts.new_full((1,), anchor), in_vocab(drafts, vocab)])),
                    [(nodes, log_marginals, support_of(vocab, n))], draft_logits.shape[-1],
                    1 if generator is not None and fixed else 0)


def ddtree(anchor: int, draft_logits: torch.Tensor, budget: int, generator: torch.Generator | None = None,
           temperature: float = 1.0, priority: AcceptanceTable | None = None, vocab: torch.Tensor | None = None,
           fixed: int = 0) -> Proposal:
    """DDTree: up to `budget` children per node under the factorized marginals. Greedy trees in one pass per
    depth (`best_paths`, over the draft vocabulary `vocab` when there is one), sampled ones by the search
    (children drawn without replacement)."""
    if generator is None:
        return best_paths(anchor, draft_logits, budget, temperature, vocab)
    return marginal_tree(anchor, draft_logits, budget, min(budget, draft_logits.shape[-1]), generator, temperature,
                         priority, fixed)


def best_paths(anchor: int, draft_logits: torch.Tensor, budget: int, temperature: float = 1.0,
               vocab: torch.Tensor | None = None) -> Proposal:
    """The greedy DDTree, best first (`weaver.static_trees.best_paths_nodes`: a beam per depth, one sort): the
    best-first search's tree (`marginal_tree`), node for node when no two paths tie (tested; with ties, paths of
    the same scores). Every node above the last depth is listed as expanded with its depth's marginal over the
    tokens the drafter can propose (`proposable`; only sampling reads these, and it uses the search)."""
    depth = min(len(draft_logits), budget)
    log_marginals = (proposable(draft_logits[:depth], vocab).float() / temperature).log_softmax(-1)
    anchor_t = torch.full((1,), anchor, dtype=torch.long, device=draft_logits.device)
    top_logp, top_index = log_marginals.topk(min(budget, log_marginals.shape[-1]), dim=-1)
    tokens, parents, depths = best_paths_nodes(anchor_t, top_logp, in_vocab(top_index, vocab), budget)
    expanded = (depths < depth).nonzero().squeeze(-1)
    return Proposal(Tree(tokens, parents), [(expanded, log_marginals[depths[expanded]], support_of(vocab, len(expanded)))],
                    draft_logits.shape[-1])


def oracle_tree(step: StepInputs, search: SearchConfig) -> Proposal:
    """Best-first over the target's own conditionals: each call verifies the tree grown so far in one
    target pass (the committed cache, `step.cache`, is untouched) and reads the new nodes' next-token
    distributions."""
    target = step.target

    def logprobs(nodes: torch.Tensor, grown: Grown) -> torch.Tensor:
        logits = target.verify(grown.tree(), step.cache)[0].logits[0, nodes]
        return (logits.float() / search.temperature).log_softmax(-1)

    return best_first_tree(step.anchor, search.budget, step.draft.logits.shape[1], logprobs,
                           min(search.budget, target.cfg.vocab_size), search.per_call(), search.generator,
                           priority=search.priority, fixed=search.fixed_children, device=target.embed.weight.device)


@exact_bf16(False)  # the adapter only proposes: bf16's fast kernels, as the drafter's (weaver.models.drafter)
def weaver_tree(step: StepInputs, search: SearchConfig) -> Proposal:
    """Best-first over the adapter's path-conditional distributions on the drafter's top-M pools.

    The drafter's block (`step.draft`, batch row 0) and the target's final-norm state of the token before
    the anchor (`step.target_hidden`) make the adapter's prefix memory. Each adapter call scores
    `search.per_call()` new nodes, which attend to the prefix memory and to their ancestors (scored in
    earlier calls); `search.compiled`: through the compiled adapter step (`WeaverAdapter.scorer`).
    Greedy with `search.rescore`: `rescored_weaver_tree`, one adapter call.
    """
    if search.rescore and search.generator is None:
        return rescored_weaver_tree(step, search)
    adapter, target, draft_logits = _adapter_of(step), step.target, step.draft.logits[0]
    pool_logits, pool_tokens = draft_pools(proposable(draft_logits, step.draft.vocab), adapter.cfg.pool_size,
                                           step.draft.vocab)
    candidates = adapter.pool_candidates(target, pool_tokens)  # (D, M, r), constant for this step
    # adapter-cache slot of a node = its index in the tree, so a node's mask row is its ancestor row
    cache = _adapter_cache(step, search.budget + 1)
    score = adapter.scorer(search.compiled)

    def logprobs(nodes: torch.Tensor, grown: Grown) -> tuple[torch.Tensor, torch.Tensor]:
        depths = grown.depths[nodes]
        scores = score(target, grown.tokens[nodes], depths, grown.ancestors[nodes], nodes, cache, pool_logits[depths],
                       candidates[depths])
        return (scores / search.temperature).log_softmax(-1), pool_tokens[depths]

    return best_first_tree(step.anchor, search.budget, len(draft_logits), logprobs, min(search.children, adapter.cfg.pool_size),
                           search.per_call(), search.generator, vocab_size=draft_logits.shape[-1], priority=search.priority,
                           fixed=search.fixed_children, device=candidates.device)


def rescored_weaver_tree(step: StepInputs, search: SearchConfig) -> Proposal:
    """Greedy Weaver in one adapter call: the best `budget` nodes, by the adapter's path scores, of the
    drafter's own best tree of `rescore` x budget nodes (`best_paths`, DDTree's greedy tree).

    The wave search needs one adapter call per wave because a node's children are only known once the node
    is scored; on a CPU each call is a graph of ~50 small kernels (0.6 ms for SmolLM2's adapter, whatever the
    number of nodes), so a budget-4 search made of four calls cost as much as the drafter's whole block.
    Here the candidates are fixed in advance and every one is scored at once, attending to its ancestors
    among them (`weaver.static_trees.rescore_candidates`; with `search.compiled` the whole selection is one
    graph). The result is the wave search's tree restricted to nodes the drafter's marginals also rank among
    their best `rescore` x budget: equal to it when those hold it, as the measured τ shows (docs/results.md). Sampling
    keeps the wave search: its children must be drawn from the adapter's distribution.
    """
    adapter, target, draft_logits = _adapter_of(step), step.target, step.draft.logits[0]
    depth = min(len(draft_logits), search.budget)  # a tree of `budget` nodes is at most that deep
    anchor = torch.full((1,), step.anchor, dtype=torch.long, device=draft_logits.device)
    r = rescorer(search.compiled)(adapter, target, adapter.candidate_table(target), anchor, draft_logits[:depth],
                                  step.draft.hidden[0], step.target_hidden, search.budget, search.rescore, search.children,
                                  step.draft.vocab)
    keep = r.keep[: int(r.n_kept)]
    tree = Tree.with_ancestors(r.tokens[keep], kept_parents(r.parents, keep), r.ancestors[keep][:, keep])
    expanded = (r.depths[keep] < depth).nonzero().squeeze(-1)  # tree nodes whose children the tree may hold
    return Proposal(tree, [(expanded, r.logprobs[keep[expanded]], r.pool_tokens[r.depths[keep[expanded]]])],
                    draft_logits.shape[-1])


def _adapter_of(step: StepInputs) -> WeaverAdapter:
    if step.adapter is None:
        raise WeaverError("method 'weaver' needs a trained adapter (stage `weaver` of train.py)")
    return step.adapter


def _adapter_cache(step: StepInputs, capacity: int) -> AdapterCache:
    """The adapter's prefix memory for this step (the target's state before the anchor, the drafter's block
    states), with room for `capacity` nodes."""
    adapter = _adapter_of(step)
    return adapter.start(adapter.prefix(step.target_hidden[None], step.draft.hidden[0][None]), capacity)


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


def chain_limit(max_depth: int, vocab_size: int, children: int, pool_size: int | None) -> tuple[int, str]:
    """A chain holds one node per drafted position: the drafter's block (block_size - 1 = max_depth)."""
    return max_depth, f"one node per drafted position, block_size - 1 = {max_depth}"


def vocabulary_limit(max_depth: int, vocab_size: int, children: int, pool_size: int | None) -> tuple[int, str]:
    """Every path of at most max_depth tokens of the vocabulary (DDTree, the oracle)."""
    return max_tree_nodes(max_depth, vocab_size), f"depth {max_depth} x vocabulary {vocab_size}"


def search_children_limit(max_depth: int, vocab_size: int, children: int, pool_size: int | None) -> tuple[int, str]:
    """`children` per node, at most the adapter's pool (the Weaver search)."""
    branching = min(children, pool_size or children)
    return max_tree_nodes(max_depth, branching), f"depth {max_depth} x {branching} children per node"


def default_children(pool: int | None) -> int:
    """Children per node when none is given: DEFAULT_CHILDREN, or the adapter's pool when that is smaller."""
    return DEFAULT_CHILDREN if pool is None else min(DEFAULT_CHILDREN, pool)


def check_children(children: int, pool: int, setting: str = "weaver.search.children") -> None:
    """The Weaver search publishes at most the adapter's pool of candidates per position as a node's children."""
    if children > pool:
        raise WeaverError(f"{setting}={children} is more than the adapter's pool of {pool} candidates per position "
                          f"(weaver.search.pool, default its weaver.pool_size): at most {pool}")


def check_budget(budget: int, limit: int | None = None, method: str = "tree", why: str = "") -> None:
    """A step's budget: a whole number of draft nodes, at least 1, and (given `limit`) no more than the
    method's tree can hold (`TreeMethod.limit`)."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise WeaverError(f"tree budget must be a whole number of draft nodes (>= 1) or a BudgetPlanner, got {budget!r}")
    if budget < 1:
        raise WeaverError(f"tree budget must be at least 1 draft node, got {budget}")
    if limit is not None and budget > limit:
        raise WeaverError(f"budget {budget} is more than a {method} tree can hold: at most {limit} draft nodes ({why})")


@dataclass(frozen=True)
class TreeMethod:
    """One tree method: its builder, the most draft nodes its tree can hold (max_depth, vocab_size, children,
    adapter pool) -> (limit, why), the models it needs besides the target and the drafter, whether the
    eval measures it at the drafter's whole block instead of at each budget (the chain), and whether greedy
    `budget: auto` may choose each step's budget from the step's own tree (`weaver.budget.StepwisePlanner`:
    its path probabilities are the drafter's calibrated marginals, and its largest tree costs little more to
    build than a small one; not so for a search that calls a model per wave)."""

    build: Callable[[StepInputs, SearchConfig], Proposal]
    limit: Callable[[int, int, int, int | None], tuple[int, str]]
    needs: tuple[str, ...] = ()
    whole_block: bool = False
    stepwise: bool = False


# To add a method: a builder (StepInputs, SearchConfig) -> Proposal and one entry here; the engine, the
# budget checks, eval.py (`eval.methods`) and the SGLang worker read this table.
TREE_METHODS: dict[str, TreeMethod] = {
    "chain": TreeMethod(lambda step, search: chain_tree(step.anchor, step.draft.logits[0], search.budget,
                                                        search.generator, search.temperature, step.draft.vocab,
                                                        search.fixed_children),
                        chain_limit, whole_block=True, stepwise=True),
    "ddtree": TreeMethod(lambda step, search: ddtree(step.anchor, step.draft.logits[0], search.budget, search.generator,
                                                     search.temperature, search.priority, step.draft.vocab,
                                                     search.fixed_children),
                         vocabulary_limit, stepwise=True),
    "weaver": TreeMethod(weaver_tree, search_children_limit, needs=("adapter",)),
    "oracle": TreeMethod(oracle_tree, vocabulary_limit),
}


def tree_method(name: str) -> TreeMethod:
    if name not in TREE_METHODS:
        raise WeaverError(f"unknown tree method '{name}'; available: {', '.join(TREE_METHODS)}")
    return TREE_METHODS[name]


def propose(method: str, step: StepInputs, search: SearchConfig) -> Proposal:
    """The draft tree of one step by `method` (`TREE_METHODS`)."""
    return tree_method(method).build(step, search)
