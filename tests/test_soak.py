"""Soak: long speculative runs with every tree method and acceptance rule, checking every few steps that the
committed target cache and drafter context equal a fresh prefill of the committed tokens (tolerance:
tests/cache_checks.py), and that greedy output equals plain greedy decoding.

engine.py is not touched: the target's `commit` is wrapped on the instance to record each step's verified
tree (`Pending.tree`) and accepted leaf, from which the committed tokens are rebuilt; the engine's drafter is
a thin wrapper around a real random `Drafter` that keeps a handle on its context cache and, for greedy runs,
nudges its block toward the greedy continuation so that long paths are accepted too.

Sizes: `smoke` runs by default (CI); `full` is marked slow (`python -m pytest -m slow tests/test_soak.py`).
Each test prints one line: tokens, steps, comparisons, max abs drift, longest accepted path, accepted
paths off the tree's first chain (their KV is moved on commit), seconds.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest
import torch

from cache_checks import assert_cache_matches, assert_context_matches, prefill
from hf_tiny import VOCAB
from test_adapter import BLOCK, make_adapter
from test_engine import random_drafter
from weaver.engine import speculative_generate
from weaver.generate import generate
from weaver.models.adapter import WeaverAdapter
from weaver.models.cache import ModelCache
from weaver.models.drafter import Draft, Drafter, DrafterCache
from weaver.models.steps import Pending
from weaver.models.target import TargetModel


@dataclass(frozen=True)
class Size:
    prompt_lengths: tuple[int, ...]
    new_tokens: int  # per prompt
    every: int  # compare the caches with a fresh prefill every `every` steps (and after the last one)


SIZES = {"smoke": Size((7, 30), 80, 3), "full": Size((3, 24, 1, 50), 440, 3)}
BUDGETS = {"chain": None, "ddtree": 12, "weaver": 12, "oracle": 8}
RUNS = [(method, 0.0, "rrs") for method in BUDGETS] + \
       [(method, 1.0, sampling) for sampling in ("rrs", "target_only") for method in BUDGETS]


class SoakDrafter:
    """What the engine drafts with: a real `Drafter` (its context cache kept as `self.context`). Given the
    greedy `sequence`, each block's logits favour the tokens that continue it; in 15% of the blocks one
    position is spoiled (the path stops there) and in 30% one is demoted just below another token (a tree
    holds it as a later sibling, so the accepted path leaves the tree's first chain). Greedy steps thus
    accept long, partial, empty and off-chain paths."""

    def __init__(self, drafter: Drafter, sequence: list[int] | None, seed: int = 0):
        self.drafter, self.cfg, self.sequence, self.rng = drafter, drafter.cfg, sequence, random.Random(seed)
        self.context: DrafterCache | None = None
        self.dtype = drafter.dtype

    def new_cache(self, batch_size: int, max_len: int) -> DrafterCache:
        self.context = self.drafter.new_cache(batch_size, max_len)
        return self.context

    def extend_context(self, context: DrafterCache, taps: list[torch.Tensor], positions: torch.Tensor) -> None:
        self.drafter.extend_context(context, taps, positions)

    def draft(self, target: TargetModel, cache: DrafterCache, anchor: torch.Tensor, anchor_position: torch.Tensor,
              max_depth: int | None = None, compiled: bool | str = False) -> Draft:
        draft = self.drafter.draft(target, cache, anchor, anchor_position, max_depth, compiled)
        if self.sequence is None:
            return draft
        start = int(anchor_position) + 1
        ahead = torch.tensor(self.sequence[start : start + draft.logits.shape[1]], dtype=torch.long)
        logits = draft.logits.clone()
        logits[0, torch.arange(len(ahead)), ahead] += 20.0
        roll = self.rng.random()
        if len(ahead) and roll < 0.45:
            miss = self.rng.randrange(len(ahead))
            row, token = logits[0, miss], ahead[miss]
            runner_up = row.clone().index_fill_(0, token, -torch.inf).max()
            row[token] = runner_up - (40.0 if roll < 0.15 else 0.1)
        return Draft(logits, draft.hidden)


class CommitRecorder:
    """Wraps `target.commit` (on the instance): records each committed path and every `every` steps, before
    committing, checks the target cache and the drafter context against a fresh prefill of the tokens so far."""

    def __init__(self, target: TargetModel, drafter: SoakDrafter, prompt: list[int], every: int):
        self.target, self.drafter, self.every = target, drafter, every
        self.real_commit = target.commit
        self.committed, self.accepted, self.branched = list(prompt), [], 0
        self.cache: ModelCache | None = None
        self.comparisons, self.drift = 0, 0.0

    def commit(self, cache: ModelCache, pending: Pending, leaf: int) -> None:
        self.cache = cache
        if len(self.accepted) % self.every == 0:
            self.compare()
        self.real_commit(cache, pending, leaf=leaf)
        path = pending.tree.path_to(leaf)
        self.committed += pending.tree.tokens[path].tolist()
        self.accepted.append(len(path) - 1)
        self.branched += path.tolist() != list(range(len(path)))  # the path's KV moves to consecutive slots

    def compare(self) -> None:
        reference, reference_context = prefill(self.target, self.drafter.drafter, self.committed, self.cache.max_len)
        self.drift = max(self.drift, assert_cache_matches(self.cache, reference),
                         assert_context_matches(self.drafter.context, reference_context))
        self.comparisons += 1


@pytest.fixture(scope="module")
def models(target) -> tuple[Drafter, WeaverAdapter]:
    """A random drafter of BLOCK tokens and a random Weaver adapter for it."""
    torch.manual_seed(3)
    return random_drafter(target, BLOCK), make_adapter(target)


def soak_prompts(size: Size) -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in size.prompt_lengths]


def soak_one(target: TargetModel, models: tuple[Drafter, WeaverAdapter], prompt: list[int], size: Size, method: str,
             temperature: float, sampling: str, monkeypatch: pytest.MonkeyPatch) -> CommitRecorder:
    """One speculative run under the recorder; checks the output against the committed tokens (and, greedy,
    against plain greedy decoding). Returns the recorder."""
    drafter, adapter = models
    greedy = generate(target, [prompt], size.new_tokens + BLOCK)[0] if temperature == 0 else None
    soak_drafter = SoakDrafter(drafter, None if greedy is None else prompt + greedy, seed=len(prompt))
    recorder = CommitRecorder(target, soak_drafter, prompt, size.every)
    monkeypatch.setattr(target, "commit", recorder.commit)
    out, stats = speculative_generate(target, soak_drafter, prompt, size.new_tokens, temperature,
                                      generator=torch.Generator().manual_seed(len(prompt)), method=method,
                                      budget=BUDGETS[method], adapter=adapter, sampling=sampling, children=4)
    monkeypatch.undo()
    recorder.compare()  # the state after the last commit
    assert stats.accepted == recorder.accepted
    emitted = recorder.committed[len(prompt) :]
    assert len(out) == size.new_tokens and out[: len(emitted)] == emitted[: len(out)]
    if greedy is not None:
        assert out == greedy[: size.new_tokens]
    return recorder


@pytest.mark.parametrize("size", ["smoke", pytest.param("full", marks=pytest.mark.slow)])
@pytest.mark.parametrize("method,temperature,sampling", RUNS)
def test_long_runs_keep_caches_equal_to_a_fresh_prefill(target, models, size, method, temperature, sampling,
                                                        monkeypatch):
    """Over long runs of one method and acceptance rule, every few steps the target cache and drafter context
    equal a fresh prefill of the committed tokens, the recorded paths rebuild the output, and greedy output
    equals plain greedy decoding."""
    start, prompts = time.perf_counter(), soak_prompts(SIZES[size])
    runs = [soak_one(target, models, prompt, SIZES[size], method, temperature, sampling, monkeypatch)
            for prompt in prompts]
    tokens = sum(len(run.committed) - len(prompt) for run, prompt in zip(runs, prompts))
    kind = "hybrid" if any(t != "full_attention" for t in target.cfg.layer_types) else "dense"
    print(f"\nsoak {size} {kind} {method} T={temperature}{'' if temperature == 0 else ' ' + sampling}: "
          f"{tokens} committed tokens, {sum(len(r.accepted) for r in runs)} steps, "
          f"{sum(r.comparisons for r in runs)} comparisons, max drift {max(r.drift for r in runs):.2e}, "
          f"longest path {max(max(r.accepted) for r in runs) + 1}, {sum(r.branched for r in runs)} off-chain paths, "
          f"{time.perf_counter() - start:.1f} s")
