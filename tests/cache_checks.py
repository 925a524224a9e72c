"""Shared checks for tests/test_properties.py and tests/test_soak.py: a target cache (and a drafter context
cache) built by verify + commit steps must equal a fresh prefill of the committed tokens.

Tolerance: ATOL = 1e-5 absolute, on fp32 models. Both sides compute the same values in different orders
(tree attention vs SDPA, the ancestor-masked parallel GDN form + rank-|path| commit vs the chunked prefill
form, tree conv vs the conv buffer), so they differ by float32 rounding only. Measured over the 42k
committed tokens of the full tests/test_soak.py: at most 1.8e-6 on attention keys, 2.7e-7 on values and
conv windows, 2.3e-6 on the drafter context, 9e-9 on the GDN states (whose entries are about 5e-3, so for
them 1e-5 is loose: about 2e-3 relative). A real error (a wrong, missing or misplaced token) moves these
tensors by 5e-3 (GDN states) to 0.5-4 (the rest) in the negative controls of tests/test_properties.py,
which require more than 1e-4: 1e-5 is 4x above rounding and 10x below an error. Bookkeeping (`length`,
`next_position`, `valid`) must match exactly.
"""

from __future__ import annotations

import torch

from weaver.models.cache import ModelCache
from weaver.models.drafter import Drafter, DrafterCache
from weaver.models.target import TargetModel
from weaver.tree import Tree

ATOL = 1e-5


def max_abs_diff(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((mine - theirs).abs().max()) if mine.numel() else 0.0


def cache_drift(cache: ModelCache, reference: ModelCache) -> dict[str, float]:
    """Max |cache - reference| per tensor: attention KV over the used slots, GDN state and conv window."""
    n, drift = cache.length, {}
    for layer, (k, v, k_ref, v_ref) in enumerate(zip(cache.keys, cache.values, reference.keys, reference.values)):
        if k is not None:
            drift[f"layer {layer} keys"] = max_abs_diff(k[:, :, :n], k_ref[:, :, :n])
            drift[f"layer {layer} values"] = max_abs_diff(v[:, :, :n], v_ref[:, :, :n])
    for layer, (s, c, s_ref, c_ref) in enumerate(zip(cache.recurrent, cache.conv, reference.recurrent, reference.conv)):
        if s is not None:
            drift[f"layer {layer} GDN state"] = max_abs_diff(s, s_ref)
            drift[f"layer {layer} conv window"] = max_abs_diff(c, c_ref)
    return drift


def context_drift(context: DrafterCache, reference: DrafterCache) -> dict[str, float]:
    """Max |context - reference| per drafter layer's projected context keys and values, over the used slots."""
    n, drift = context.length, {}
    for layer, (k, v, k_ref, v_ref) in enumerate(zip(context.keys, context.values, reference.keys, reference.values)):
        drift[f"drafter layer {layer} keys"] = max_abs_diff(k[:, :, :n], k_ref[:, :, :n])
        drift[f"drafter layer {layer} values"] = max_abs_diff(v[:, :, :n], v_ref[:, :, :n])
    return drift


def within_tolerance(drift: dict[str, float], what: str) -> float:
    """Assert every drift is at most ATOL (NaN fails too); returns the largest."""
    bad = {name: d for name, d in drift.items() if not d <= ATOL}
    assert not bad, f"{what} differs from a fresh prefill by more than {ATOL}: {bad}"
    return max(drift.values(), default=0.0)


def assert_cache_matches(cache: ModelCache, reference: ModelCache) -> float:
    """Assert a target cache equals a reference (bookkeeping exactly, tensors within ATOL); returns the max drift."""
    assert cache.length == reference.length, f"length {cache.length} != {reference.length}"
    assert torch.equal(cache.next_position, reference.next_position), "next_position differs"
    assert torch.equal(cache.valid, reference.valid), "valid slots differ"
    return within_tolerance(cache_drift(cache, reference), "target cache")


def assert_context_matches(context: DrafterCache, reference: DrafterCache) -> float:
    """Assert a drafter context cache equals a reference over its used slots; returns the max drift."""
    assert context.length == reference.length, f"drafter context length {context.length} != {reference.length}"
    return within_tolerance(context_drift(context, reference), "drafter context")


@torch.inference_mode()
def prefill(target: TargetModel, drafter: Drafter, tokens: list[int], max_len: int) -> tuple[ModelCache, DrafterCache]:
    """Fresh target cache and drafter context holding `tokens`, built in one prefill."""
    cache, context = target.new_cache(1, max_len), drafter.new_cache(1, max_len)
    out = target(torch.tensor([tokens]), cache, tap_layers=drafter.cfg.target_layer_ids, logits_to_keep=0)
    drafter.extend_context(context, out.taps, torch.arange(len(tokens))[None])
    return cache, context


@torch.inference_mode()
def verify_and_commit(target: TargetModel, drafter: Drafter, cache: ModelCache, context: DrafterCache, tree: Tree,
                      leaf: int) -> list[int]:
    """One engine step driven by hand: verify `tree`, commit the root-to-`leaf` path into the target cache and
    its taps into the drafter context (as `weaver.engine.speculative_generate` does). Returns the path's tokens."""
    taps = drafter.cfg.target_layer_ids
    anchor_position = cache.next_position.clone()
    verified, pending = target.verify(tree, cache, taps)
    target.commit(cache, pending, leaf=leaf)
    path = tree.path_to(leaf)
    positions = anchor_position[:, None] + torch.arange(len(path))
    drafter.extend_context(context, [t[:, path] for t in verified.taps], positions)
    return tree.tokens[path].tolist()
