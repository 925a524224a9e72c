"""Speculative generation (weaver.engine) is lossless: greedy output equals plain autoregressive greedy
decoding token for token, with drafts that are mostly wrong (a random drafter) and mostly right (an
oracle test double that knows the greedy continuation), on a hybrid GDN target and an attention-only one.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from hf_tiny import VOCAB, draft_vocab_drafter
from weaver.engine import speculative_generate
from weaver.errors import WeaverError
from weaver.generate import generate
from weaver.models.drafter import Draft, Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config

NEW = 48
BLOCKS = (2, 5, 16)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 2, 7, 13, 20, 31]
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def greedy(target, prompts):
    """AR greedy continuation of each prompt, a block longer than NEW so an oracle can draft past the end."""
    return [generate(target, [p], NEW + max(BLOCKS))[0] for p in prompts]


def random_drafter(target, block_size: int) -> Drafter:
    torch.manual_seed(block_size)
    cfg = new_drafter_config(target, num_layers=1, block_size=block_size, mask_token_id=VOCAB - 1, num_taps=2)
    return Drafter(drafter_config(cfg)).eval()


class OracleDrafter:
    """Test double: drafts the true greedy continuation, but corrupts one block position with
    probability `p_corrupt`. Also checks what the engine feeds it: the context must be exactly the
    committed positions before the anchor, in order, and the anchor must be the committed token there."""

    def __init__(self, target, sequence: list[int], block_size: int, p_corrupt: float = 0.3, seed: int = 0):
        self.cfg = SimpleNamespace(target_layer_ids=(0, 1), block_size=block_size, mask_token_id=VOCAB - 1)
        self.sequence, self.hidden, self.dtype = sequence, target.cfg.hidden_size, torch.float32  # its logits
        self.p_corrupt, self.rng = p_corrupt, random.Random(seed)
        self.corrupted = 0

    def new_cache(self, batch_size: int, max_len: int):
        assert batch_size == 1
        return SimpleNamespace(positions=[], max_len=max_len)

    def extend_context(self, cache, taps, positions):
        assert len(taps) == len(self.cfg.target_layer_ids)
        n = positions.shape[1]
        assert all(t.shape == (1, n, self.hidden) for t in taps)
        cache.positions += positions[0].tolist()
        assert cache.positions == list(range(len(cache.positions))), "context positions are not contiguous"
        assert len(cache.positions) <= cache.max_len

    def draft(self, target, cache, anchor, anchor_position, max_depth=None, compiled=False):
        B, P = self.cfg.block_size, int(anchor_position)
        assert len(cache.positions) == P, "the context must cover exactly the positions before the anchor"
        assert int(anchor) == self.sequence[P], "the anchor is not the committed token at its position"
        tokens = [self.sequence[P + d] if P + d < len(self.sequence) else self.rng.randrange(VOCAB)
                  for d in range(1, B)]
        if self.rng.random() < self.p_corrupt:
            j = self.rng.randrange(B - 1)
            tokens[j] = (tokens[j] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
            self.corrupted += 1
        logits = torch.randn(1, B - 1, VOCAB)
        logits[0, torch.arange(B - 1), torch.tensor(tokens)] = 10.0
        return Draft(logits[:, :max_depth], torch.zeros(1, B - 1, self.hidden))


@pytest.mark.parametrize("block_size", BLOCKS)
def test_greedy_with_random_drafter_equals_autoregressive(target, prompts, greedy, block_size):
    drafter = random_drafter(target, block_size)
    for prompt, ref in zip(prompts, greedy):
        out, stats = speculative_generate(target, drafter, prompt, NEW, temperature=0)
        assert out == ref[:NEW], f"prompt length {len(prompt)}"
        assert 1 + sum(a + 1 for a in stats.accepted) >= NEW
        assert all(0 <= a <= block_size - 1 for a in stats.accepted)


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 9)])
def test_greedy_with_a_draft_vocabulary_equals_autoregressive(target, prompts, greedy, method, budget):
    """A drafter restricted to a third of the vocabulary drafts only those tokens (the target's greedy tokens
    outside it are its bonus tokens) and stays lossless."""
    drafter, _ = draft_vocab_drafter(target, 5, VOCAB // 3, seed=2)
    drafted = []
    drafter.draft = lambda *args, _draft=drafter.draft, **kwargs: drafted.append(_draft(*args, **kwargs)) or drafted[-1]
    for prompt, ref in zip(prompts, greedy):
        out, _ = speculative_generate(target, drafter, prompt, NEW, temperature=0, method=method, budget=budget)
        assert out == ref[:NEW], f"prompt length {len(prompt)}"
    picks = torch.cat([d.logits.topk(3, dim=-1).indices.flatten() for d in drafted])
    assert bool(torch.isin(picks, drafter.draft_vocab).all())


@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 6), ("weaver", 6)])
def test_greedy_with_a_bf16_drafter_beside_an_fp32_target_equals_autoregressive(target, prompts, greedy, method, budget):
    """`drafter.dtype=bfloat16` on an fp32 target: the draft comes back in fp32 for the search (and Weaver's
    adapter) and the output stays the target's greedy one."""
    from weaver.models.adapter import AdapterConfig, WeaverAdapter

    drafter = random_drafter(target, 8).to(torch.bfloat16)
    t = target.cfg
    adapter = WeaverAdapter(AdapterConfig(t.hidden_size, t.vocab_size, 7, 32, 1, 2, 64, 16, 8)).eval()
    for prompt, ref in zip(prompts, greedy):
        out, _ = speculative_generate(target, drafter, prompt, NEW, temperature=0, method=method, budget=budget,
                                      adapter=adapter)
        assert out == ref[:NEW], f"prompt length {len(prompt)}"


@pytest.mark.parametrize("block_size", BLOCKS)
def test_greedy_with_mostly_right_drafts_equals_autoregressive(target, prompts, greedy, block_size):
    accepted, steps, corrupted = 0, 0, 0
    for i, (prompt, ref) in enumerate(zip(prompts, greedy)):
        oracle = OracleDrafter(target, prompt + ref, block_size, seed=i)
        out, stats = speculative_generate(target, oracle, prompt, NEW, temperature=0)
        assert out == ref[:NEW], f"prompt length {len(prompt)}"
        assert sum(a + 1 for a in stats.accepted) >= len(out) - 1
        accepted, steps, corrupted = accepted + sum(stats.accepted), steps + len(stats.accepted), corrupted + oracle.corrupted
        tau = sum(a + 1 for a in stats.accepted) / len(stats.accepted)
        assert stats.tau == pytest.approx(tau)
    assert corrupted > 0  # the reject path inside long accepted runs was exercised too
    tau = (accepted + steps) / steps
    assert tau > 1 + 0.5 * (block_size - 1), f"tau {tau:.2f}: correct drafts are not being accepted"


@pytest.mark.parametrize("drafter_kind", ["random", "oracle"])
def test_eos_stops_where_autoregressive_stops(target, prompts, greedy, drafter_kind):
    prompt, ref = prompts[3], greedy[3][:NEW]
    # the first token whose first occurrence is well inside the output
    eos = next(t for i, t in enumerate(ref) if i >= 9 and t not in ref[:i])
    expected = generate(target, [prompt], NEW, eos_token_id=eos)[0]
    assert expected == ref[: ref.index(eos) + 1] and len(expected) < NEW
    for block_size in (5, 16):
        drafter = random_drafter(target, block_size) if drafter_kind == "random" else \
            OracleDrafter(target, prompt + greedy[3], block_size, p_corrupt=0.0)
        out, _ = speculative_generate(target, drafter, prompt, NEW, temperature=0, eos_token_id=eos)
        assert out == expected


def test_eos_as_first_token(target, prompts, greedy):
    eos = greedy[2][0]
    out, stats = speculative_generate(target, random_drafter(target, 5), prompts[2], NEW, eos_token_id=eos)
    assert out == [eos] and stats.accepted == []


def test_empty_prompt_is_refused(target):
    with pytest.raises(WeaverError, match="at least one token"):
        speculative_generate(target, random_drafter(target, 4), [], 8)


@pytest.mark.parametrize("method,block_size,mode", [("chain", 16, True), ("ddtree", 5, True), ("ddtree", 5, "max-autotune")])
def test_compiled_verify_greedy_equals_autoregressive(target, prompts, greedy, method, block_size, mode):
    """The engine with the compiled verify pass (trees padded to their size bucket), in each inductor mode
    (max-autotune: frozen weights, every matmul's kernel benchmarked), emits the target's own greedy tokens, through long accepted runs and rejections, on the graphs `compile_verify` built (no
    compilation inside decoding, for contexts of 2 tokens or more: dynamo specialises a start of 1). From no
    graphs at all: a graph traced on `compile_verify`'s small cache must not be specialised to its length
    (with duck sizing a cache of 8 slots shared a symbol with the GDN key head dimension 8)."""
    torch._dynamo.reset()
    target.compile_verify({block_size}, (0, 1), mode)
    graphs = counters["stats"]["unique_graphs"]
    corrupted = 0
    for i, (prompt, ref) in sorted(enumerate(zip(prompts, greedy)), key=lambda item: len(item[1][0]) < 2):
        oracle = OracleDrafter(target, prompt + ref, block_size, seed=i)
        out, stats = speculative_generate(target, oracle, prompt, NEW, temperature=0, method=method, compiled=mode)
        assert out == ref[:NEW], f"prompt length {len(prompt)}"
        corrupted += oracle.corrupted
        if len(prompt) >= 2:
            assert counters["stats"]["unique_graphs"] == graphs, f"recompiled for a prompt of {len(prompt)} tokens"
    assert corrupted > 0 and stats.tau > 1.5


def test_a_method_added_by_one_registry_entry_is_decoded_and_evaluated(target, prompts, greedy, monkeypatch):
    """The README's recipe for a new tree method: one builder and one `TREE_METHODS` entry. The engine decodes
    with it (greedy output = AR, drafts accepted) and eval.py accepts it at the config's budgets."""
    from omegaconf import OmegaConf

    from weaver.builders import TREE_METHODS, TreeMethod, marginal_tree, vocabulary_limit
    from weaver.eval.run import check_names, method_spec

    def sharpened(step, search):
        return marginal_tree(step.anchor, 2 * step.draft.logits[0], search.budget, search.children, search.generator,
                             search.temperature)

    monkeypatch.setitem(TREE_METHODS, "sharpened", TreeMethod(sharpened, vocabulary_limit))
    prompt, ref = prompts[2], greedy[2][:NEW]
    out, stats = speculative_generate(target, OracleDrafter(target, prompt + greedy[2], 5), prompt, NEW,
                                      method="sharpened", budget=6)
    assert out == ref and sum(stats.accepted) > 0
    cfg = OmegaConf.create({"eval": {"methods": ["ar", "sharpened"], "datasets": [], "budgets": [4, 8], "seed": 0,
                                     "backend": "torch", "rrs_priority": "draft", "draft_temperature": None, "fixed_children": 0, "compile": False,
                                     "prepack": True},
                             "prompt_sets": {}})
    check_names(cfg)
    assert method_spec("sharpened").budgets(cfg, {}) == [4, 8] and method_spec("sharpened").needs == ("drafter",)
