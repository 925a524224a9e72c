"""Speculative generation (reference engine, batch 1): draft a block, verify it as a tree, commit.

Verification never writes the committed target state: `TargetModel.verify` leaves GDN states and conv
windows untouched and puts attention KV in scratch slots; `TargetModel.commit` keeps only the accepted
path (rollback-free, DESIGN.md §2.6). The drafter's context cache grows by the committed tokens' taps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from weaver.errors import WeaverError
from weaver.builders import chain_tree, check_budget, ddtree, oracle_tree
from weaver.generate import sample_next, until_eos
from weaver.models.cache import ModelCache
from weaver.models.drafter import Drafter
from weaver.models.target import TargetModel
from weaver.tree import Tree
from weaver.verify import greedy_tree, speculative_sampling_chain, target_only_tree


@dataclass
class SpecStats:
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verify step
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tau(self) -> float:
        """Committed tokens per target verify step, the bonus token included."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))


def check_pair(target: TargetModel, drafter: Drafter) -> None:
    """Refuse a drafter that does not fit the target, with one clear message."""
    t, d = target.cfg, drafter.cfg
    if d.body.hidden_size != t.hidden_size:
        raise WeaverError(f"drafter hidden size {d.body.hidden_size} does not match the target's {t.hidden_size}")
    if d.body.vocab_size not in (0, t.vocab_size):
        raise WeaverError(f"drafter vocab {d.body.vocab_size} does not match the target's {t.vocab_size}")
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise WeaverError(f"drafter mask_token_id {d.mask_token_id} is outside the target vocab ({t.vocab_size})")
    if len(set(d.target_layer_ids)) != len(d.target_layer_ids):
        raise WeaverError(f"drafter taps a target layer twice: {list(d.target_layer_ids)}")
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise WeaverError(f"drafter taps target layers {bad}, but the target has {t.num_layers} layers")


TREE_METHODS = ("chain", "ddtree", "oracle")


def propose(
    method: str, anchor: int, draft_logits: torch.Tensor, budget: int, target: TargetModel, cache: ModelCache
) -> Tree:
    """The draft tree of one step; see `weaver.builders`."""
    if method == "chain":
        return chain_tree(anchor, draft_logits, budget)
    if method == "ddtree":
        return ddtree(anchor, draft_logits, budget)
    if method == "oracle":
        return oracle_tree(anchor, budget, len(draft_logits), target, cache)
    raise WeaverError(f"unknown tree method '{method}'; available: {', '.join(TREE_METHODS)}")


@torch.inference_mode()
def speculative_generate(
    target: TargetModel,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    method: str = "chain",
    budget: int | None = None,
) -> tuple[list[int], SpecStats]:
    """New tokens for one prompt with draft trees, plus acceptance statistics.

    method: chain (DFlash), ddtree or oracle (`weaver.builders`); budget: draft nodes per step
    (default and maximum for chain: block_size - 1). Sampling (temperature > 0): chains are drawn from the
    drafter's marginals and verified by speculative sampling; trees are built as for greedy decoding and
    verified target-only (`weaver.verify.target_only_tree`). Both are lossless.
    """
    if not prompt:
        raise WeaverError("every prompt must contain at least one token")
    budget = drafter.cfg.block_size - 1 if budget is None else budget
    check_budget(budget)
    device = target.embed.weight.device
    taps, block = drafter.cfg.target_layer_ids, drafter.cfg.block_size
    max_len = len(prompt) + max_new_tokens + max(block, budget + 1)
    cache, context = target.new_cache(1, max_len), drafter.new_cache(1, max_len)
    ids = torch.tensor([prompt], device=device)
    out = target(ids, cache, tap_layers=taps, logits_to_keep=1)
    drafter.extend_context(context, out.taps, torch.arange(len(prompt), device=device)[None])
    anchor = sample_next(out.logits[:, -1], temperature, generator)
    new, stats = [int(anchor)], SpecStats()
    while len(new) < max_new_tokens and new[-1] != eos_token_id:
        start = time.perf_counter()
        draft_logits = drafter.draft(target, context, anchor, cache.next_position)[0]
        if temperature <= 0 or method != "chain":
            tree, draft_probs = propose(method, int(anchor), draft_logits, budget, target, cache), None
        else:  # chain drafts sampled from the drafter's marginals
            draft_probs = torch.softmax(draft_logits[:budget].float() / temperature, dim=-1)
            drafts = torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)
            tree = Tree.chain(torch.cat([anchor, drafts]))
        mid = time.perf_counter()
        anchor_position = cache.next_position.clone()
        verified, pending = target.verify(tree, cache, taps)
        logits = verified.logits[0]
        if temperature <= 0:
            leaf, bonus = greedy_tree(tree, logits)
        elif draft_probs is None:
            leaf, bonus = target_only_tree(tree, logits, temperature, generator)
        else:
            leaf, bonus = speculative_sampling_chain(logits, draft_probs, tree.tokens[1:], temperature, generator)
        target.commit(cache, pending, leaf=leaf)
        path = tree.path_to(leaf)
        positions = anchor_position[:, None] + torch.arange(len(path), device=device)
        drafter.extend_context(context, [t[:, path] for t in verified.taps], positions)
        stats.draft_s += mid - start
        stats.verify_s += time.perf_counter() - mid
        stats.accepted.append(len(path) - 1)
        new += tree.tokens[path[1:]].tolist() + [bonus]
        anchor = torch.tensor([bonus], device=device)
    return until_eos(new[:max_new_tokens], eos_token_id), stats
