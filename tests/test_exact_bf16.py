"""bf16 targets on a CPU, attention-only and hybrid GDN, are lossless token for token: a tree's logits in a verify pass are bitwise the logits of
decoding each node's path one token at a time, eager and compiled, so greedy speculation reproduces bf16 AR
decoding exactly (`weaver.models.layers.exact_math`: the math between matmuls in float64;
`weaver.models.linear.INVARIANT_ROWS`: matmuls in fixed-size row calls). bf16 logits tie often, so a
path that rounds differently shows up as a different argmax quickly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from hf_tiny import VOCAB, save_tiny_hf_model
from test_tree_verify import random_tree
from weaver.engine import speculative_generate
from weaver.generate import generate
from weaver.models.checkpoint import load_target
from weaver.models import linear
from weaver.models.adapter import AdapterConfig, WeaverAdapter
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config
from weaver.models.linear import exact_bf16, prepacked_weights
from weaver.tree import Tree

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN (mkldnn) not built in")


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory):
    """An attention-only target as wide as SmolLM2 (576), where oneDNN's bf16 kernels change with the row count
    (above 32 rows on a Xeon with AMX), in bf16."""
    folder = tmp_path_factory.mktemp("qwen3_wide")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, num_hidden_layers=2, rms_norm_eps=1e-5,
                         max_position_embeddings=512, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.mul_(4.0)  # activations with spread, as in a trained model
    hf.save_pretrained(folder)
    return load_target(str(folder), torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_hybrid(tmp_path_factory):
    """A hybrid target (Qwen3.5: Gated DeltaNet layers, whose verify pass solves the tree's system where decoding
    runs the recurrence, and a gated attention layer), in bf16."""
    folder = tmp_path_factory.mktemp("qwen3_5")
    torch.manual_seed(0)
    save_tiny_hf_model("qwen3_5_text", folder)
    return load_target(str(folder), torch.bfloat16)


def decode_path(target, context: torch.Tensor, tokens: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """Logits after each of `tokens`, decoded one at a time after `context`'s prefill (as `generate` decodes)."""
    step = target.decode_fn(compiled)
    cache = target.new_cache(1, context.shape[1] + len(tokens) + 1)
    target.prefill(context, cache)
    return torch.cat([step(t.view(1, 1), cache).logits[0] for t in tokens])


@torch.inference_mode()
@pytest.mark.parametrize("T,shape,prepack", [(5, "chain", True), (17, "random", True), (40, "random", True),
                                             (65, "star", True), (40, "random", False)])
def test_tree_logits_are_bitwise_the_decoded_path_logits(bf16_target, T, shape, prepack):
    """Also with `eval.prepack` off: the target's bf16 products take the row-invariant path regardless."""
    with prepacked_weights(prepack):
        check_tree_against_decoding(bf16_target, T, shape)


@torch.inference_mode()
@pytest.mark.parametrize("T,shape", [(5, "chain"), (17, "random"), (40, "random")])
def test_hybrid_tree_logits_are_bitwise_the_decoded_path_logits(bf16_hybrid, T, shape):
    """GDN layers too: conv, gates, the recurrence and the tree's solve in float64, with float64 conv and GDN states,
    so the parallel form and the recurrence round to the same bf16 outputs."""
    check_tree_against_decoding(bf16_hybrid, T, shape)


def check_tree_against_decoding(bf16_target, T: int, shape: str) -> None:
    gen = torch.Generator().manual_seed(T)
    context = torch.randint(3, VOCAB, (1, 37), generator=gen)  # a prefill over 32 rows: chunked too
    tree = random_tree(T, gen, shape)
    cache = bf16_target.new_cache(1, 128)
    bf16_target.prefill(context, cache)
    out, _ = bf16_target.verify(tree, cache)
    for node in range(T):
        decoded = decode_path(bf16_target, context, tree.tokens[tree.path_to(node)])[-1]
        assert torch.equal(out.logits[0, node], decoded), f"node {node} of a {shape} tree of {T}"


@torch.inference_mode()
def test_compiled_decode_and_verify_are_bitwise_eager_decoding(bf16_target):
    """inductor rounds bf16 as eager code does (`emulate_precision_casts`), so the compiled decode step and a
    compiled verify pass (a 40-node chain padded to the 65-node bucket: chunked products) give eager's logits."""
    gen = torch.Generator().manual_seed(3)
    context, tokens = torch.randint(3, VOCAB, (1, 12), generator=gen), torch.randint(3, VOCAB, (40,), generator=gen)
    eager = decode_path(bf16_target, context, tokens)
    assert torch.equal(decode_path(bf16_target, context, tokens, compiled=True), eager)
    cache = bf16_target.new_cache(1, 128)
    bf16_target.prefill(context, cache)
    out, _ = bf16_target.verify(Tree.chain(tokens), cache, compiled=True)
    assert torch.equal(out.logits[0], eager[:40])


def bf16_drafter(target) -> Drafter:
    torch.manual_seed(1)
    cfg = new_drafter_config(target, num_layers=1, block_size=16, mask_token_id=VOCAB - 1, num_taps=2)
    return Drafter(drafter_config(cfg)).eval().to(torch.bfloat16)


def bf16_adapter(target) -> WeaverAdapter:
    torch.manual_seed(3)
    adapter = WeaverAdapter(AdapterConfig(target.cfg.hidden_size, VOCAB, 15, 64, 1, 2, 128, 16, 32)).eval()
    torch.nn.init.normal_(adapter.query.weight, std=0.5)  # a correction that reorders the pools
    return adapter.to(torch.bfloat16)


@torch.inference_mode()
@pytest.mark.parametrize("method,budget,rescore", [("chain", None, None), ("ddtree", 48, None), ("weaver", 24, None),
                                                   ("weaver", 15, 2)])
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_greedy_speculation_in_bf16_equals_bf16_autoregressive_decoding(request, kind, method, budget, rescore):
    """Compiled too for the hybrid target (its decode and verify graphs). The drafter and the adapter propose
    with the fast kernels; only the target is exact."""
    bf16_target = request.getfixturevalue("bf16_target" if kind == "attention" else "bf16_hybrid")
    drafter = bf16_drafter(bf16_target)
    adapter = bf16_adapter(bf16_target) if method == "weaver" else None
    gen = torch.Generator().manual_seed(2)
    for n in (3, 40):
        prompt = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        reference = generate(bf16_target, [prompt], 40)[0]
        out, _ = speculative_generate(bf16_target, drafter, prompt, 40, temperature=0, method=method, budget=budget,
                                      adapter=adapter, rescore=rescore, compiled=kind == "hybrid")
        assert out == reference, f"prompt of {n} tokens"


def recording_exact_setting(fn, settings: list[bool]):
    """`fn`, noting whether the exact path was on at each call."""
    return lambda *args, **kwargs: settings.append(linear.exact_bf16_enabled()) or fn(*args, **kwargs)


@torch.inference_mode()
@pytest.mark.parametrize("compiled", [False, True])
def test_the_drafter_drafts_with_the_fast_kernels(bf16_target, compiled, monkeypatch):
    """A draft only proposes, so a bf16 drafter skips the exact path (float64 math between matmuls): its block is
    the fast kernels' and not the exact path's, and its context is read without the exact path too."""
    drafter = bf16_drafter(bf16_target)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    taps = bf16_target.prefill(ids, bf16_target.new_cache(1, 32), tap_layers=drafter.cfg.target_layer_ids).taps
    settings = []
    monkeypatch.setattr(drafter, "context", recording_exact_setting(drafter.context, settings))
    drafter.extend_context(cache := drafter.new_cache(1, 32), taps, torch.arange(30)[None])
    assert settings == [False] and linear.exact_bf16_enabled()
    anchor, position = ids[:, -1], torch.tensor([30])
    got = drafter.draft(bf16_target, cache, anchor, position, compiled=compiled).logits
    with exact_bf16(False):
        fast = drafter.block(bf16_target, cache, anchor, position, 15).logits
    exact = drafter.block(bf16_target, cache, anchor, position, 15).logits
    assert torch.equal(got, fast) and not torch.equal(got, exact)


@torch.inference_mode()
def test_the_weaver_search_scores_with_the_fast_kernels(bf16_target, monkeypatch):
    """The adapter proposes too: every call it gets in a step runs without the exact path."""
    drafter, adapter = bf16_drafter(bf16_target), bf16_adapter(bf16_target)
    settings = []
    monkeypatch.setattr(adapter, "score_nodes", recording_exact_setting(adapter.score_nodes, settings))
    speculative_generate(bf16_target, drafter, [5, 6, 7], 6, method="weaver", budget=8, adapter=adapter)
    assert settings and not any(settings) and linear.exact_bf16_enabled()


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_the_prefill_reads_the_prompt_with_the_fast_kernels(request, kind):
    """One matmul call per product and bf16 math for the prompt (its cache still float64): not the exact path's
    logits, the fast kernels' (every decoder reads a prompt this way, so AR and speculation still agree: above)."""
    target = request.getfixturevalue("bf16_target" if kind == "attention" else "bf16_hybrid")
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    prefilled = target.prefill(ids, cache := target.new_cache(1, 48)).logits[0, -1]
    exact = target(ids, target.new_cache(1, 48), logits_to_keep=1).logits[0, -1]
    fast_cache = target.new_cache(1, 48)  # float64, as the engine's
    with exact_bf16(False):
        fast = target(ids, fast_cache, logits_to_keep=1).logits[0, -1]
    assert {k.dtype for k in cache.keys if k is not None} == {torch.float64} and cache.length == 40
    assert torch.equal(prefilled, fast) and not torch.equal(prefilled, exact)


@torch.inference_mode()
def test_the_cache_keeps_keys_and_values_in_float64_when_exact(bf16_target):
    """The attention reads them in float64 anyway (stored so, they convert once); the data stages' fast kernels keep
    bf16, and a cache made in one setting still runs in the other."""
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    exact_cache = bf16_target.new_cache(1, 8)
    with exact_bf16(False):
        fast_cache = bf16_target.new_cache(1, 8)
        assert bf16_target(ids, exact_cache).logits.isfinite().all()
    assert (exact_cache.keys[0].dtype, fast_cache.keys[0].dtype) == (torch.float64, torch.bfloat16)
    assert torch.equal(bf16_target(ids, bf16_target.new_cache(1, 8)).logits, bf16_target(ids).logits)


@torch.inference_mode()
def test_the_cache_keeps_conv_and_gdn_states_in_float64_when_exact(bf16_hybrid):
    exact_cache = bf16_hybrid.new_cache(1, 8)
    with exact_bf16(False):
        fast_cache = bf16_hybrid.new_cache(1, 8)
    assert (exact_cache.conv[0].dtype, exact_cache.recurrent[0].dtype) == (torch.float64, torch.float64)
    assert (fast_cache.conv[0].dtype, fast_cache.recurrent[0].dtype) == (torch.bfloat16, torch.float32)
