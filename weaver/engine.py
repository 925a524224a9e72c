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
from weaver.generate import sample_next, until_eos
from weaver.models.drafter import Drafter
from weaver.models.target import TargetModel
from weaver.tree import Tree
from weaver.verify import greedy_chain, speculative_sampling_chain


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


@torch.inference_mode()
def speculative_generate(
    target: TargetModel,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], SpecStats]:
    """New tokens for one prompt with chain drafts (DFlash), plus acceptance statistics."""
    if not prompt:
        raise WeaverError("every prompt must contain at least one token")
    device = target.embed.weight.device
    taps, block = drafter.cfg.target_layer_ids, drafter.cfg.block_size
    max_len = len(prompt) + max_new_tokens + block
    cache, context = target.new_cache(1, max_len), drafter.new_cache(1, max_len)
    ids = torch.tensor([prompt], device=device)
    out = target(ids, cache, tap_layers=taps, logits_to_keep=1)
    drafter.extend_context(context, out.taps, torch.arange(len(prompt), device=device)[None])
    anchor = sample_next(out.logits[:, -1], temperature, generator)
    new, stats = [int(anchor)], SpecStats()
    while len(new) < max_new_tokens and new[-1] != eos_token_id:
        start = time.perf_counter()
        draft_logits = drafter.draft(target, context, anchor, cache.next_position)[0]
        draft_probs = None if temperature <= 0 else torch.softmax(draft_logits.float() / temperature, dim=-1)
        drafts = sample_next(draft_logits, temperature, generator) if draft_probs is None else \
            torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)
        mid = time.perf_counter()
        anchor_position = cache.next_position.clone()
        verified, pending = target.verify(Tree.chain(torch.cat([anchor, drafts])), cache, taps)
        logits = verified.logits[0]
        if temperature <= 0:
            n, bonus = greedy_chain(logits, drafts)
        else:
            n, bonus = speculative_sampling_chain(logits, draft_probs, drafts, temperature, generator)
        target.commit(cache, pending, leaf=n)
        positions = anchor_position[:, None] + torch.arange(n + 1, device=device)
        drafter.extend_context(context, [t[:, : n + 1] for t in verified.taps], positions)
        stats.draft_s += mid - start
        stats.verify_s += time.perf_counter() - mid
        stats.accepted.append(n)
        new += drafts[:n].tolist() + [bonus]
        anchor = torch.tensor([bonus], device=device)
    return until_eos(new[:max_new_tokens], eos_token_id), stats
