"""The factorized block drafter (docs/method.md §2.2) and z-lab's DFlash checkpoint format.

A from-scratch reference of the DFlash draft forward (written from raw checkpoint tensors, the way
z-lab's `DFlashDraftModel` computes it: context and block keys/values through the same k/v projections,
k_norm on both, RoPE over [context positions, block positions], no mask, final norm + target lm_head)
checks that our fused model reads the format correctly.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters
from transformers import Qwen3Config

from hf_tiny import VOCAB, draft_vocab_drafter, save_tiny_hf_model
from weaver.errors import WeaverError
from weaver.models.checkpoint import load_target
from weaver.models.drafter import Drafter, default_target_layers, depth_bucket
from weaver.models.drafter_checkpoint import drafter_config, load_drafter, new_drafter_config, save_drafter
from weaver.models.target import TargetModel
from weaver.train.drafter import init_from_target, rope_theta

MASK = VOCAB - 1
HIDDEN = 64  # hf_tiny's hidden size


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid_target")
    torch.manual_seed(0)
    save_tiny_hf_model("qwen3_5_text", folder)  # 4 layers
    return load_target(str(folder))


def perturb_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random non-trivial values everywhere (norm scales start at ones, which would hide mix-ups)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))


def target_states(target, ids: torch.Tensor) -> list[torch.Tensor]:
    """Output of every decoder layer of the target for ids (1, T), in layer order."""
    with torch.no_grad():
        return target(ids, tap_layers=tuple(range(target.cfg.num_layers))).taps


# --- a from-scratch reference of z-lab's DFlash draft forward -------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@torch.no_grad()
def reference_draft_logits(w: dict[str, torch.Tensor], cfg: dict, target, layer_states: list[torch.Tensor],
                           context_len: int, anchor: int) -> torch.Tensor:
    """Logits (block_size - 1, V) for an anchor at position `context_len`, context = positions before it."""
    eps, B, C = cfg["rms_norm_eps"], cfg["block_size"], context_len
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    taps = [layer_states[i][0, :C] for i in cfg["dflash_config"]["target_layer_ids"]]  # declared order
    ctx = rms(torch.cat(taps, -1) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (C, hidden)
    block = [anchor] + [cfg["dflash_config"]["mask_token_id"]] * (B - 1)
    x = target.embed.weight[block]  # (B, hidden)
    theta = cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = torch.arange(C + B, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]  # (C + B, 1, D)
    for i in range(cfg["num_hidden_layers"]):
        a, p = f"layers.{i}.self_attn.", f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rms((h @ w[a + "q_proj.weight"].T).view(B, H, D), w[a + "q_norm.weight"], eps)
        kv_in = torch.cat([ctx, h])
        k = rms((kv_in @ w[a + "k_proj.weight"].T).view(C + B, Hkv, D), w[a + "k_norm.weight"], eps)
        v = (kv_in @ w[a + "v_proj.weight"].T).view(C + B, Hkv, D)
        q = q * cos[C:] + rotate_half(q) * sin[C:]
        k = k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * D**-0.5, dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(B, H * D) @ w[a + "o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return (rms(x, w["norm.weight"], eps) @ target.lm_head.weight.T)[1:]


@torch.no_grad()
def incremental_draft_logits(drafter: Drafter, target, layer_states: list[torch.Tensor], context_len: int,
                             anchor: int) -> torch.Tensor:
    cache = drafter.new_cache(1, context_len + 1)
    taps = [layer_states[i][:, :context_len] for i in drafter.cfg.target_layer_ids]
    drafter.extend_context(cache, taps, torch.arange(context_len)[None])
    return drafter.draft(target, cache, torch.tensor([anchor]), torch.tensor([context_len])).logits[0]


# --- hand-written DFlash checkpoints ----------------------------------------------------------------------


def dflash_tensors(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, n_taps: int,
                   gen: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=gen)

    def norm(n):
        return 1.0 + r(n, scale=0.3)

    w = {"fc.weight": r(hidden, n_taps * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(layers):
        a, p = f"layers.{i}.self_attn.", f"layers.{i}."
        w |= {
            a + "q_proj.weight": r(heads * head_dim, hidden), a + "k_proj.weight": r(kv_heads * head_dim, hidden),
            a + "v_proj.weight": r(kv_heads * head_dim, hidden), a + "o_proj.weight": r(hidden, heads * head_dim),
            a + "q_norm.weight": norm(head_dim), a + "k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
            p + "mlp.down_proj.weight": r(hidden, inter),
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
        }
    return w


# The drafter's attention geometry differs from the target's on purpose: only the hidden size must match.
SHAPE = dict(hidden=HIDDEN, layers=2, heads=2, kv_heads=1, head_dim=24, inter=80)


def write_dflash_checkpoint(folder, *, taps=(0, 2), mask=MASK, block_size=5, num_target_layers=4, prefix="",
                            style="save_pretrained", drop=(), with_dflash=True, seed=0, **shape):
    """A DFlash checkpoint written by hand; returns (tensors without prefix, config dict as z-lab reads it)."""
    s = SHAPE | shape
    tensors = dflash_tensors(s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["head_dim"], s["inter"],
                             len(taps), torch.Generator().manual_seed(seed))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v for k, v in tensors.items() if k not in drop}, folder / "model.safetensors")
    dflash = {"architectures": ["DFlashDraftModel"], "block_size": block_size, "num_target_layers": num_target_layers,
              "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": mask}}
    geometry = dict(vocab_size=VOCAB, hidden_size=s["hidden"], num_hidden_layers=s["layers"], intermediate_size=s["inter"],
                    num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                    rms_norm_eps=1e-6, tie_word_embeddings=False)
    if style == "save_pretrained":
        Qwen3Config(**geometry, rope_parameters={"rope_type": "default", "rope_theta": 1e6}).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
    else:  # the raw JSON of a released z-lab checkpoint (transformers 4.x era: top-level rope_theta)
        config = {"model_type": "qwen3", "hidden_act": "silu", "attention_bias": False, "rope_theta": 1e6,
                  "rope_scaling": None, "max_position_embeddings": 40960, "torch_dtype": "float32", **geometry}
    if with_dflash:
        config |= dflash
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return tensors, config | geometry | {"rope_theta": 1e6} | dflash


# --- tests -------------------------------------------------------------------------------------------------


def test_default_target_layers():
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layers(64, 5) == (1, 16, 31, 46, 61)  # z-lab's Qwen3.5-27B drafter
    assert default_target_layers(36, 1) == (18,)  # DFlash taps the middle layer for a single tap
    assert default_target_layers(4, 3) == (1,)  # tiny targets: a layer is tapped once


def test_save_writes_the_dflash_format_and_reloads_identically(target, tmp_path):
    gen = torch.Generator().manual_seed(1)
    hf_cfg = new_drafter_config(target, num_layers=2, block_size=6, mask_token_id=MASK, target_layer_ids=(0, 2))
    drafter = Drafter(drafter_config(hf_cfg)).eval()
    perturb_(drafter, gen)
    save_drafter(drafter, hf_cfg, tmp_path / "drafter")

    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 6
    assert config["num_target_layers"] == target.cfg.num_layers
    assert config["dflash_config"]["target_layer_ids"] == list(drafter.cfg.target_layer_ids) == [0, 2]
    assert config["dflash_config"]["mask_token_id"] == MASK
    assert config["hidden_size"] == target.cfg.hidden_size

    tensors = load_file(tmp_path / "drafter" / "model.safetensors")
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{n}_proj.weight" for n in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}
        expected |= {f"layers.{i}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        expected |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert set(tensors) == expected  # in particular no embed_tokens / lm_head: the target's are shared
    t = target.cfg
    kv_rows = t.num_kv_heads * t.head_dim
    assert tensors["fc.weight"].shape == (t.hidden_size, 2 * t.hidden_size)
    assert tensors["layers.1.self_attn.k_proj.weight"].shape == (kv_rows, t.hidden_size)
    assert tensors["layers.1.mlp.up_proj.weight"].shape == (t.intermediate_size, t.hidden_size)
    torch.testing.assert_close(tensors["layers.1.self_attn.v_proj.weight"], drafter.layers[1].attn.kv.weight[kv_rows:], rtol=0, atol=0)
    torch.testing.assert_close(tensors["layers.1.mlp.up_proj.weight"], drafter.layers[1].mlp.gate_up.weight[t.intermediate_size:], rtol=0, atol=0)

    loaded = load_drafter(str(tmp_path / "drafter"), target)
    assert loaded.cfg.block_size == 6 and loaded.cfg.mask_token_id == MASK
    assert loaded.cfg.target_layer_ids == drafter.cfg.target_layer_ids
    mine, theirs = drafter.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        torch.testing.assert_close(theirs[name], mine[name], rtol=0, atol=0)

    ids = torch.randint(3, VOCAB, (1, 9), generator=gen)
    states = target_states(target, ids)
    torch.testing.assert_close(incremental_draft_logits(loaded, target, states, 9, 7),
                               incremental_draft_logits(drafter, target, states, 9, 7), rtol=0, atol=0)
    # and both agree with the from-scratch reference of the format
    torch.testing.assert_close(incremental_draft_logits(loaded, target, states, 9, 7),
                               reference_draft_logits(tensors, config, target, states, 9, 7), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefix,style", [("", "save_pretrained"), ("model.", "save_pretrained"), ("", "zlab_json")])
def test_hand_written_checkpoint_loads_and_matches_reference(target, tmp_path, prefix, style):
    tensors, config = write_dflash_checkpoint(tmp_path / "d", prefix=prefix, style=style, taps=(0, 2))
    drafter = load_drafter(str(tmp_path / "d"), target)
    cfg = drafter.cfg
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (5, (0, 2), MASK)
    assert (cfg.body.num_heads, cfg.body.num_kv_heads, cfg.body.head_dim) == (2, 1, 24)

    # k/v fusion: kv = cat(k_proj, v_proj), in that order
    a = "layers.0.self_attn."
    torch.testing.assert_close(drafter.layers[0].attn.kv.weight,
                               torch.cat([tensors[a + "k_proj.weight"], tensors[a + "v_proj.weight"]]), rtol=0, atol=0)
    torch.testing.assert_close(drafter.layers[0].mlp.gate_up.weight,
                               torch.cat([tensors["layers.0.mlp.gate_proj.weight"], tensors["layers.0.mlp.up_proj.weight"]]), rtol=0, atol=0)

    # first layer's context keys, from scratch: fc -> hidden_norm -> k_proj -> k_norm -> RoPE
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 11), generator=gen)
    states = target_states(target, ids)
    C, eps, D = 11, 1e-6, 24
    with torch.no_grad():
        feats = rms(torch.cat([states[0][0], states[2][0]], -1) @ tensors["fc.weight"].T, tensors["hidden_norm.weight"], eps)
        k = rms((feats @ tensors[a + "k_proj.weight"].T).view(C, 1, D), tensors[a + "k_norm.weight"], eps)
        inv_freq = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        f = torch.arange(C, dtype=torch.float64)[:, None] * inv_freq
        emb = torch.cat([f, f], -1)
        k_ref = k * emb.cos().float()[:, None] + rotate_half(k) * emb.sin().float()[:, None]
        cache = drafter.new_cache(1, C + 1)
        drafter.extend_context(cache, [states[0], states[2]], torch.arange(C)[None])
    torch.testing.assert_close(cache.keys[0][0, :, :C].transpose(0, 1), k_ref, rtol=1e-5, atol=1e-5)
    v_ref = (feats @ tensors[a + "v_proj.weight"].T).view(C, 1, D)
    torch.testing.assert_close(cache.values[0][0, :, :C].transpose(0, 1), v_ref, rtol=1e-5, atol=1e-5)

    # whole draft forward against the reference
    torch.testing.assert_close(incremental_draft_logits(drafter, target, states, C, 42),
                               reference_draft_logits(tensors, config, target, states, C, 42), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden=32), "hidden size 32 does not match the target's 64"),
    (dict(taps=(1, 4)), r"taps target layers \[4\], but the target has 4 layers"),
    (dict(taps=(1, 1)), r"taps a target layer twice: \[1, 1\]"),
    (dict(mask=VOCAB), f"mask_token_id {VOCAB} is outside the target vocab"),
    (dict(drop=("layers.1.self_attn.v_proj.weight",)), "lacks layers.1.self_attn.v_proj.weight"),
    (dict(with_dflash=False), "not a DFlash drafter config"),
    (dict(block_size=1), "block_size must be at least 2"),
])
def test_mismatched_drafter_is_refused(target, tmp_path, kwargs, message):
    write_dflash_checkpoint(tmp_path / "d", **kwargs)
    with pytest.raises(WeaverError, match=message):
        load_drafter(str(tmp_path / "d"), target)


def test_weights_that_do_not_fit_the_config_are_refused(target, tmp_path):
    write_dflash_checkpoint(tmp_path / "d")
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    tensors["layers.0.self_attn.q_proj.weight"] = tensors["layers.0.self_attn.q_proj.weight"][:-3]
    save_file(tensors, tmp_path / "d" / "model.safetensors")
    with pytest.raises(WeaverError, match="do not fit its config.json"):
        load_drafter(str(tmp_path / "d"), target)


@torch.no_grad()
def test_training_forward_with_mask_equals_incremental_drafting(target):
    """Two anchors packed in one training-style forward, each block seeing only the context before its
    anchor (mask True = may attend), equal drafting each anchor with a cache of exactly that context."""
    gen = torch.Generator().manual_seed(7)
    hf_cfg = new_drafter_config(target, num_layers=2, block_size=5, mask_token_id=MASK, target_layer_ids=(1, 3))
    drafter = Drafter(drafter_config(hf_cfg)).eval()
    perturb_(drafter, gen)
    B, C = 5, 12
    ids = torch.randint(3, VOCAB, (1, C), generator=gen)
    states = target_states(target, ids)
    taps = [states[i] for i in drafter.cfg.target_layer_ids]
    context = drafter.context(taps)  # (1, C, H)
    a1, a2 = 4, C  # anchor 1 inside the sequence (its token is ids[a1]); anchor 2 right after it
    tok1, tok2 = int(ids[0, a1]), 17
    embeds = torch.cat([drafter.block_inputs(target, torch.tensor([tok1])), drafter.block_inputs(target, torch.tensor([tok2]))], 1)
    positions = torch.cat([a1 + torch.arange(B), a2 + torch.arange(B)])[None]
    mask = torch.zeros(1, 1, 2 * B, C + 2 * B, dtype=torch.bool)
    mask[0, 0, :B, :a1] = True
    mask[0, 0, :B, C : C + B] = True
    mask[0, 0, B:, :a2] = True
    mask[0, 0, B:, C + B :] = True
    hidden = drafter(embeds, positions, context, torch.arange(C)[None], mask)
    logits = target.lm_head(hidden[0])
    first, second = logits[1:B], logits[B + 1 :]
    torch.testing.assert_close(first, incremental_draft_logits(drafter, target, states, a1, tok1), rtol=0, atol=1e-5)
    torch.testing.assert_close(second, incremental_draft_logits(drafter, target, states, a2, tok2), rtol=0, atol=1e-5)

    # the mask matters: without it the first block sees the future context and the other block
    unmasked = target.lm_head(drafter(embeds, positions, context, torch.arange(C)[None], None)[0])
    assert (unmasked[1:B] - first).abs().max() > 1e-3


@torch.no_grad()
def test_a_depth_limited_draft_is_the_first_rows_of_the_full_one(target):
    drafter = Drafter(drafter_config(new_drafter_config(target, 2, 6, MASK, target_layer_ids=(1, 3)))).eval()
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    taps = [target_states(target, ids)[i] for i in drafter.cfg.target_layer_ids]
    cache = drafter.new_cache(1, 16)
    drafter.extend_context(cache, taps, torch.arange(9)[None])
    full = drafter.draft(target, cache, torch.tensor([5]), torch.tensor([9]))
    for depth in (1, 3, 5, 40):
        limited = drafter.draft(target, cache, torch.tensor([5]), torch.tensor([9]), max_depth=depth)
        assert limited.logits.shape[1] == min(depth, 5) and torch.equal(limited.hidden, full.hidden)
        torch.testing.assert_close(limited.logits, full.logits[:, :depth], rtol=0, atol=1e-6)


def test_depth_buckets():
    assert [depth_bucket(d, 15) for d in range(1, 17)] == [1, 2, 4, 4, 8, 8, 8, 8] + [15] * 8
    assert [depth_bucket(d, 3) for d in (1, 2, 3)] == [1, 2, 3]


@pytest.mark.parametrize("mode", [True, "max-autotune"])
@torch.inference_mode()
def test_compiled_draft_equals_eager_for_every_depth_and_context(target, mode):
    """The compiled block (a graph per logit-row bucket, the context length dynamic) against the eager one,
    over random context lengths and depths, on the graphs `compile_draft` built beforehand (none traced
    inside the loop)."""
    gen = torch.Generator().manual_seed(3)
    drafter = Drafter(drafter_config(new_drafter_config(target, 2, 9, MASK, target_layer_ids=(1, 3)))).eval()
    perturb_(drafter, gen)
    torch._dynamo.reset()
    drafter.compile_draft(target, set(range(1, 9)), mode)
    graphs = counters["stats"]["unique_graphs"]
    for trial in range(6):
        n = int(torch.randint(2, 30, (1,), generator=gen))
        ids = torch.randint(3, VOCAB, (1, n), generator=gen)
        cache = drafter.new_cache(1, 32)
        drafter.extend_context(cache, [target_states(target, ids)[i] for i in (1, 3)], torch.arange(n)[None])
        anchor, position = torch.randint(3, VOCAB, (1,), generator=gen), torch.tensor([n])
        for depth in (1, 3, 8, None):
            eager = drafter.draft(target, cache, anchor, position, depth)
            compiled = drafter.draft(target, cache, anchor, position, depth, compiled=mode)
            assert compiled.logits.shape == eager.logits.shape
            torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(compiled.hidden, eager.hidden, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs, "a draft recompiled after compile_draft"


@pytest.mark.parametrize("compiled", [False, True])
@torch.inference_mode()
def test_a_draft_vocabulary_drafts_its_tokens_only_and_round_trips(target, tmp_path, compiled):
    """Restricted to a draft vocabulary, a drafter's logits are the unrestricted drafter's on those tokens and
    the lowest finite value elsewhere (eager and compiled); the vocabulary survives a save and a load."""
    drafter, hf_cfg = draft_vocab_drafter(target, 6, 40, seed=5, num_taps=4)
    perturb_(drafter, torch.Generator().manual_seed(6))
    unrestricted = Drafter(drafter_config(new_drafter_config(target, 1, 6, MASK, 4))).eval()
    unrestricted.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"})
    ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(7))
    taps = [target_states(target, ids)[i] for i in drafter.cfg.target_layer_ids]
    save_drafter(drafter, hf_cfg, tmp_path / "d")
    loaded = load_drafter(str(tmp_path / "d"), target)
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab) and loaded.cfg.draft_vocab_size == 40
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[drafter.draft_vocab] = False
    for model in (drafter, loaded, unrestricted):
        model.cache = model.new_cache(1, 16)
        model.extend_context(model.cache, taps, torch.arange(11)[None])
    full = unrestricted.draft(target, unrestricted.cache, torch.tensor([5]), torch.tensor([11]))
    for model in (drafter, loaded):
        for depth in (1, 3, None):
            draft = model.draft(target, model.cache, torch.tensor([5]), torch.tensor([11]), depth, compiled=compiled)
            rows = full.logits.shape[1] if depth is None else depth
            torch.testing.assert_close(draft.logits[..., drafter.draft_vocab], full.logits[:, :rows, drafter.draft_vocab],
                                       rtol=1e-4, atol=1e-4)
            assert bool((draft.logits[..., outside] == torch.finfo(draft.logits.dtype).min).all())
            assert bool(torch.isin(draft.logits.argmax(-1), drafter.draft_vocab).all())


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("draft_vocab"), "lacks draft_vocab"),
    (lambda t: t.update(draft_vocab=t["draft_vocab"].float()), "distinct ascending int64"),
    (lambda t: t.update(draft_vocab=t["draft_vocab"].flip(0)), "distinct ascending int64"),
    (lambda t: t.update(draft_vocab=t["draft_vocab"][:-1]), "distinct ascending int64"),
    (lambda t: t.update(draft_vocab=t["draft_vocab"] + VOCAB), "outside the target vocab"),
])
def test_a_bad_draft_vocabulary_is_refused(target, tmp_path, edit, message):
    drafter, hf_cfg = draft_vocab_drafter(target, 6, 40, seed=5, num_taps=4)
    save_drafter(drafter, hf_cfg, tmp_path / "d")
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "d" / "model.safetensors")
    with pytest.raises(WeaverError, match=message):
        load_drafter(str(tmp_path / "d"), target)


@pytest.mark.parametrize("size", [0, -3, VOCAB + 1, 2.5])
def test_a_draft_vocabulary_size_outside_the_target_vocab_is_refused(target, size):
    with pytest.raises(WeaverError, match="draft_vocab must be between 1 and"):
        new_drafter_config(target, 1, 6, MASK, 2, draft_vocab_size=size)


@torch.no_grad()
def test_unsorted_target_layer_ids_are_honoured_or_refused(target, tmp_path):
    tensors, config = write_dflash_checkpoint(tmp_path / "d", taps=(2, 0))
    drafter = load_drafter(str(tmp_path / "d"), target)
    ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(4))
    taps = target(ids, tap_layers=drafter.cfg.target_layer_ids).taps  # what the engine feeds the drafter
    cache = drafter.new_cache(1, 12)
    drafter.extend_context(cache, taps, torch.arange(11)[None])
    ours = drafter.draft(target, cache, torch.tensor([42]), torch.tensor([11])).logits[0]
    torch.testing.assert_close(ours, reference_draft_logits(tensors, config, target, target_states(target, ids), 11, 42),
                               rtol=1e-4, atol=1e-4)


def test_frequent_tokens_mix_the_sources_frequencies():
    from weaver.train.drafter import frequent_tokens, token_counts

    responses = token_counts([[7, 7, 3, 9, 9, 9], [3, 5, 5, 1, 40]], 12)  # 40: past the vocabulary, dropped
    assert responses.tolist() == [0, 1, 0, 2, 0, 2, 0, 2, 0, 3, 0, 0]
    assert frequent_tokens([responses], 3).tolist() == [3, 5, 9]  # 9 x3, then 3, 5, 7 x2: ties keep the lower ids
    corpus = token_counts([[11] * 50 + [7] * 30 + [9] * 20], 12)
    # mixture: 11 .5, 7 .3 + 2/10, 9 .2 + 3/10, 3 and 5 2/10 each
    assert frequent_tokens([responses, corpus], 3).tolist() == [7, 9, 11]


@pytest.mark.parametrize("read", [None, (True, False)], ids=["rollouts", "one read text"])
def test_distillation_loss_over_a_draft_vocabulary(target, read):
    """The loss of a draft-vocabulary drafter is cross-entropy (and KL to the target renormalised) over its
    vocabulary, labels outside it left out; its accuracy counts every label. A row of text the target read
    (`read`) is trained on the KL alone, at every position, and left out of the accuracy. Reference: by hand
    from the block states."""
    from weaver.train.drafter import distillation_loss, draft_blocks

    drafter, _ = draft_vocab_drafter(target, 4, 30, seed=9, num_taps=2)
    drafter.train()
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    ids[:, 10:] = drafter.draft_vocab[torch.randint(0, 30, (2, 14), generator=g)]  # half the labels in the vocabulary
    lengths, anchors = torch.tensor([24, 20]), torch.tensor([[9, 15], [11, 12]])
    gamma, kl_weight = 3.0, 0.4
    loss, logs = distillation_loss(drafter, target, ids, lengths, anchors, gamma, kl_weight,
                                   read=None if read is None else torch.tensor(read))
    is_read = read or (False, False)

    with torch.no_grad():
        out = target(ids, tap_layers=drafter.cfg.target_layer_ids, logits_to_keep=0)
        hidden = draft_blocks(drafter, target, ids, anchors, out.taps)
        head = target.lm_head.weight[drafter.draft_vocab]
        total, weights, hits, counted, chains = 0.0, 0.0, 0, 0, []
        for n in range(2):
            for m in range(2):
                leading = 0 if int(anchors[n, m]) + 1 < int(lengths[n]) and not is_read[n] else None
                for d in range(1, 4):
                    pos = int(anchors[n, m]) + d
                    if pos >= int(lengths[n]):
                        continue
                    label, scored = int(ids[n, pos]), d == 1 and not is_read[n]
                    logp = (hidden[n, m, d - 1] @ head.T).log_softmax(-1)
                    counted += scored
                    hits += scored and int(drafter.draft_vocab[logp.argmax()]) == label
                    if leading == d - 1 and int(drafter.draft_vocab[logp.argmax()]) == label:
                        leading = d  # the chain accepts every position up to here
                    teacher = (out.hidden[n, pos - 1] @ head.T).log_softmax(-1)
                    kl = (teacher.exp() * (teacher - logp)).sum()
                    w = torch.exp(torch.tensor(-(d - 1) / gamma))
                    if is_read[n]:
                        total, weights = total + w * kl, weights + w
                        continue
                    if label not in drafter.draft_vocab.tolist():
                        continue
                    ce = -logp[drafter.draft_vocab.tolist().index(label)]
                    total, weights = total + w * ((1 - kl_weight) * ce + kl_weight * kl), weights + w
                if leading is not None:
                    chains.append(1 + leading)
    torch.testing.assert_close(loss, total / weights, rtol=1e-4, atol=1e-5)
    assert logs["acc_d1"] == pytest.approx(hits / counted)
    assert logs["tau_chain"] == pytest.approx(sum(chains) / len(chains))


def smoke_config(outputs, *overrides):
    from hydra import compose, initialize_config_dir

    from weaver.pipeline import ROOT_CONF

    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        return compose("train", overrides=["+experiment=smoke", f"paths.root={outputs}", "wandb.enabled=false", *overrides])


def test_heldout_rollouts_are_not_trained_on_and_report_top1_and_chain_length(smoke_outputs, tmp_path, monkeypatch):
    """drafter.train.heldout_rollouts=8: training sees the other 40 of the smoke run's 48 rollouts, and the summary
    carries top-1 and the greedy chain's acceptance length on the 8 held out; a count the rollouts cannot hold
    is refused before training."""
    import datasets

    import weaver.train.drafter as drafter_stage
    from weaver.artifacts import load_target_and_tokenizer
    from weaver.pipeline import artifact_dir

    def config(*overrides):
        return smoke_config(smoke_outputs, "drafter.train.steps=6", "drafter.train.eval_every=3", *overrides)

    seen = []  # (training?, the batch's sequences)
    real_loss = drafter_stage.distillation_loss

    def recording_loss(drafter, target, ids, lengths, *args, **kwargs):
        seen.append((torch.is_grad_enabled(), {tuple(row[:n].tolist()) for row, n in zip(ids, lengths)}))
        return real_loss(drafter, target, ids, lengths, *args, **kwargs)

    monkeypatch.setattr(drafter_stage, "distillation_loss", recording_loss)
    cfg = config("drafter.train.heldout_rollouts=8")
    target, tokenizer = load_target_and_tokenizer(cfg)
    summary = drafter_stage.train_drafter(cfg, target, tokenizer, artifact_dir(cfg, "rollouts"), tmp_path / "a",
                                          tmp_path / "a.work")
    assert 0 <= summary["heldout_acc_d1"] <= 1 and 1 <= summary["heldout_tau_chain"] <= cfg.drafter.block_size
    rollouts = datasets.load_from_disk(str(artifact_dir(cfg, "rollouts") / "dataset"))
    held = {tuple(r["prompt_ids"] + r["response_ids"]) for r in rollouts.select(range(40, 48))}
    assert [training for training, _ in seen] == [True] * 3 + [False] + [True] * 3 + [False]  # evaluated at 3 and 6
    assert all(not rows & held if training else rows == held for training, rows in seen)
    with pytest.raises(WeaverError, match="drafter.train.heldout_rollouts must be a whole number from 0 to 47"):
        drafter_stage.train_drafter(config("drafter.train.heldout_rollouts=48"), target, tokenizer,
                                    artifact_dir(cfg, "rollouts"), tmp_path / "b", tmp_path / "b.work")


def test_init_from_a_checkpoint_fine_tunes_it(smoke_outputs, tmp_path):
    """drafter.train.init=<a drafter checkpoint> trains from its weights and keeps its draft vocabulary and rotary
    base: at lr 0 the trained drafter is the checkpoint, tensor for tensor (a fresh start would not be), and it
    records the tokenizer a z-lab-style checkpoint did not; the pipeline's key follows the weights file; a
    checkpoint that is not the drafter the config describes is refused, naming what differs."""
    import os

    from weaver.artifacts import load_target_and_tokenizer
    from weaver.models.checkpoint import load_hf_config, tokenizer_fingerprint
    from weaver.models.layers import init_weights
    from weaver.pipeline import artifact_dir, stage_key
    from weaver.train.drafter import train_drafter

    base = smoke_config(smoke_outputs)
    target, tokenizer = load_target_and_tokenizer(base)
    mask = tokenizer.convert_tokens_to_ids(base.drafter.mask_token)
    hf = new_drafter_config(target, base.drafter.num_layers, base.drafter.block_size, mask, base.drafter.num_taps,
                            rope_theta=5000.0, draft_vocab_size=100)  # no tokenizer fingerprint, as z-lab's
    start = Drafter(drafter_config(hf))
    init_weights(start, 0.5)
    start.draft_vocab.copy_(torch.arange(100) * 3)  # not the frequent tokens a fresh drafter counts
    save_drafter(start, hf, tmp_path / "start")

    cfg = smoke_config(smoke_outputs, "drafter.draft_vocab=100", f"drafter.train.init={tmp_path / 'start'}",
                       "drafter.train.lr=0", "drafter.train.steps=2")
    train_drafter(cfg, target, tokenizer, artifact_dir(cfg, "rollouts"), tmp_path / "tuned", tmp_path / "tuned.work")
    tuned = load_drafter(str(tmp_path / "tuned"), target, tokenizer=tokenizer)
    for name, tensor in start.state_dict().items():
        assert torch.equal(tuned.state_dict()[name], tensor), name
    saved = load_hf_config(tmp_path / "tuned")
    assert saved.tokenizer_sha256 == tokenizer_fingerprint(tokenizer) and saved.rope_parameters["rope_theta"] == 5000.0
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["rope_theta"] == 5000.0  # for 4.x readers too

    key = stage_key(cfg, "drafter")
    assert key != stage_key(smoke_config(smoke_outputs, "drafter.draft_vocab=100"), "drafter")
    weights = tmp_path / "start" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert stage_key(cfg, "drafter") != key  # new weights under the same path: a new drafter

    for override, message in [("drafter.block_size=6", "block_size 8 \\(the config: 6\\)"),
                              ("drafter.draft_vocab=null", "draft_vocab 100 \\(the config: None\\)")]:
        bad = smoke_config(smoke_outputs, f"drafter.train.init={tmp_path / 'start'}", override, "drafter.draft_vocab=100"
                           if "vocab" not in override else override)
        with pytest.raises(WeaverError, match=f"is not the drafter the config describes: it has {message}"):
            train_drafter(bad, target, tokenizer, artifact_dir(bad, "rollouts"), tmp_path / "bad", tmp_path / "bad.work")
    for init in (tmp_path / "missing", "targt"):
        with pytest.raises(WeaverError, match="drafter.train.init must be random, target or a DFlash-format drafter "
                                              f"checkpoint: checkpoint folder not found: {init}"):
            stage_key(smoke_config(smoke_outputs, f"drafter.train.init={init}"), "drafter")


def deep_target(model_type: str, folder) -> TargetModel:
    """A random 4-layer dense target (llama: no q/k norms; qwen3: with them)."""
    from transformers import AutoModelForCausalLM

    from hf_tiny import tiny_config

    config = tiny_config(model_type)
    config.num_hidden_layers = 4
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * 4
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    perturb_(hf, torch.Generator().manual_seed(3))
    hf.save_pretrained(folder)
    return load_target(str(folder))


def drafter_from_target(target: TargetModel) -> Drafter:
    hf_cfg = new_drafter_config(target, num_layers=2, block_size=5, mask_token_id=MASK, target_layer_ids=(1, 0),
                                rope_theta=rope_theta(target.cfg))
    drafter = Drafter(drafter_config(hf_cfg)).eval()
    perturb_(drafter, torch.Generator().manual_seed(5))
    assert init_from_target(drafter, target) == (2, 3)
    return drafter


@torch.no_grad()
def test_a_drafter_started_from_the_target_computes_its_last_layers(tmp_path):
    """init=target: each drafter layer, run causally over the states the target's layer before it wrote, writes
    what that target layer wrote (norms, q/k/v/o, MLP and RoPE copied), and the context features are the
    deepest tap as the first copied layer normed it."""
    target = deep_target("qwen3", tmp_path)
    drafter = drafter_from_target(target)
    T = 9
    states = target_states(target, torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(1)))
    rope = drafter.rope(torch.arange(T)[None])
    no_context = torch.zeros(1, target.cfg.num_kv_heads, 0, target.cfg.head_dim)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    for layer, i in zip(drafter.layers, (2, 3)):
        out = layer(states[i - 1], rope, (no_context, no_context), causal)
        torch.testing.assert_close(out, states[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(drafter.context([states[1], states[0]]), target.layers[2].input_norm(states[1]),
                               rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_drafter_started_from_a_llama_target_copies_all_but_the_qk_norms_it_lacks(tmp_path):
    """DFlash layers norm q and k per head, a Llama's do not: those norms start at one, the rest is copied."""
    target = deep_target("llama", tmp_path)
    drafter = drafter_from_target(target)
    x = torch.randn(3, HIDDEN)
    for layer, source in zip(drafter.layers, target.layers[2:]):
        q, kv = source.mixer.qkv(x).split([source.mixer.q_width, layer.attn.kv.weight.shape[0]], -1)
        torch.testing.assert_close(layer.attn.q(x), q)
        torch.testing.assert_close(layer.attn.kv(x), kv)
        torch.testing.assert_close(layer.attn.o(x), source.mixer.o(x))
        torch.testing.assert_close(layer.mlp(layer.post_norm(x)), source.mlp(source.post_norm(x)))
        torch.testing.assert_close(layer.input_norm(x), source.input_norm(x))
        assert torch.equal(layer.attn.q_norm.weight, torch.ones(target.cfg.head_dim))


@torch.no_grad()
def test_a_drafter_started_from_a_hybrid_target_takes_its_attention_layer_without_the_gate(target):
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 5, MASK, target_layer_ids=(1,)))).eval()
    assert init_from_target(drafter, target) == (2,)  # the hybrid's only attention layer
    x = torch.randn(3, HIDDEN)
    source = target.layers[2].mixer
    H, D = target.cfg.num_heads, target.cfg.head_dim
    query_and_gate = source.qkv(x)[:, : source.q_width].view(3, H, 2 * D)
    torch.testing.assert_close(drafter.layers[0].attn.q(x), query_and_gate[..., :D].reshape(3, H * D))
    two = Drafter(drafter_config(new_drafter_config(target, 2, 5, MASK, target_layer_ids=(1,))))
    with pytest.raises(WeaverError, match="the target has 1 attention layers"):
        init_from_target(two, target)
    narrow = Drafter(drafter_config(new_drafter_config(target, 1, 5, MASK, target_layer_ids=(1,), intermediate_size=32)))
    with pytest.raises(WeaverError, match="needs their shape"):
        init_from_target(narrow, target)


@pytest.mark.parametrize("compiled", [False, True])
@torch.inference_mode()
def test_a_bf16_drafter_beside_an_fp32_target_drafts_within_bf16_rounding(target, compiled):
    """`drafter.dtype`: a drafter in bf16 takes the fp32 target's states and embeddings and returns its draft in
    the target's dtype, equal to the fp32 drafter's up to bf16 rounding (with and without a draft vocabulary)."""
    gen = torch.Generator().manual_seed(8)
    full = Drafter(drafter_config(new_drafter_config(target, 2, 6, MASK, target_layer_ids=(1, 3)))).eval()
    perturb_(full, gen)
    restricted = draft_vocab_drafter(target, 6, 40, seed=5, num_taps=4)[0]
    ids = torch.randint(3, VOCAB, (1, 11), generator=gen)
    states = target_states(target, ids)
    for fp32 in (full, restricted):
        bf16 = Drafter(fp32.cfg).eval()
        bf16.load_state_dict(fp32.state_dict())
        bf16.to(torch.bfloat16)
        drafts = []
        for model in (fp32, bf16):
            cache = model.new_cache(1, 16)
            model.extend_context(cache, [states[i] for i in model.cfg.target_layer_ids], torch.arange(11)[None])
            drafts.append(model.draft(target, cache, torch.tensor([5]), torch.tensor([11]), 3, compiled=compiled))
        want, got = drafts
        assert got.logits.dtype == got.hidden.dtype == torch.float32 and got.logits.shape == want.logits.shape
        torch.testing.assert_close(got.logits, want.logits, rtol=0.05, atol=0.1)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=0.05, atol=0.05)
        assert (got.logits - want.logits).abs().max() > 0  # it did compute in bf16


def test_a_drafter_moved_to_bf16_keeps_its_rope_frequencies_in_fp32(target):
    """bf16 inverse frequencies are 0.2% off: ~1 radian of RoPE angle by position 500."""
    drafter = Drafter(drafter_config(new_drafter_config(target, 1, 4, MASK, 2))).eval()
    want = drafter.rope(torch.tensor([[900]]))
    drafter.to(torch.bfloat16)
    assert drafter.rotary.inv_freq.dtype == torch.float32
    assert drafter.rope(torch.tensor([[900]]))[0].dtype == torch.bfloat16
    for got, ref in zip(drafter.rope(torch.tensor([[900]])), want):
        torch.testing.assert_close(got.float(), ref, rtol=0, atol=8e-3)  # bf16 rounding of cos/sin only


def test_drafter_dtype_applies_at_inference_and_training_reads_the_targets(target, tmp_path):
    """`load_drafter_for`: `drafter.dtype` places the drafter for decoding; a training stage passes "model" and
    gets the target's dtype whatever the setting. The head follows: the drafter's dtype, or under autocast
    (which casts for the matmul) the target's."""
    from omegaconf import OmegaConf

    from weaver.artifacts import load_drafter_for

    hf_cfg = new_drafter_config(target, 1, 4, MASK, 2)
    save_drafter(Drafter(drafter_config(hf_cfg)).eval(), hf_cfg, tmp_path / "d")
    cfg = OmegaConf.create({"drafter": {"path": str(tmp_path / "d"), "draft_vocab": None, "dtype": "bfloat16"}})
    drafter = load_drafter_for(cfg, target)
    assert drafter.dtype == torch.bfloat16 and drafter.head(target).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert drafter.head(target) is target.lm_head.weight
    assert load_drafter_for(cfg, target, "model").dtype == target.embed.weight.dtype == torch.float32
