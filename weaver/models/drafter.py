"""Factorized block drafter (DFlash-style, docs/method.md §2.2).

One forward pass drafts a whole block: the input is [anchor, MASK x (B-1)] embedded with the target's
frozen embedding; every layer's attention uses as extra keys/values the fused tapped target hidden
states of the context (positions before the anchor), projected by the same k/v projections as the
block tokens; attention inside the block is bidirectional. The drafter's final norm is followed by the
target's lm_head. Block position d predicts the token at anchor + d, independently of the draft tokens
at positions < d: the per-position distributions are marginals.

A drafter may draft from a reduced vocabulary (`draft_vocab`: the target token ids it can propose, the
most frequent ones of its training data, as EAGLE-3 and FR-Spec do): its head is then those rows of
the target's lm_head only, a fraction of a large-vocabulary draft's cost, and every other token gets the
lowest finite logit (probability 0). Verification is the target's, so drafting stays lossless.

For the same reason a bf16 drafter on a CPU drafts with the fast kernels (`exact_bf16(False)`): the exact path
(float64 math between matmuls) is for the target, whose logits decide every token; a draft's last bits only
move which tree is proposed. The compiled draft of SmolLM2's 4-layer drafter costs 8.1 ms instead of 10.0, its
context extension 1.6 ms instead of 2.4 (docs/results.md: "Drafts and the adapter's search with bf16's fast
kernels").

The body is a Qwen3 decoder stack, so its architecture is a `TargetConfig` read from a Qwen3Config;
`weaver.models.drafter_checkpoint` reads and writes z-lab's DFlash checkpoint format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from weaver.errors import WeaverError
from weaver.models.compile import Compile, compile_step, inductor_mode
from weaver.models.config import TargetConfig
from weaver.models.layers import MLP, RMSNorm, Rotary, apply_rope
from weaver.models.linear import Linear, exact_bf16, linear

if TYPE_CHECKING:  # the drafting side runs without the target's verification kernels
    from weaver.models.target import TargetModel


@dataclass(frozen=True)
class DrafterConfig:
    body: TargetConfig  # Qwen3-style decoder stack (hidden size = the target's)
    block_size: int
    target_layer_ids: tuple[int, ...]  # decoder layers of the target whose outputs are tapped
    mask_token_id: int
    num_target_layers: int | None = None  # layers of the target it was made for (DFlash's `num_target_layers`)
    tokenizer_sha256: str | None = None  # fingerprint of the target tokenizer it was trained with (ours only)
    draft_vocab_size: int | None = None  # tokens it drafts from (None: the target's whole vocabulary)


def default_target_layers(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """DFlash's choice: `num_taps` layers evenly spaced from layer 1 to L-3 (1, 9, 17, 25, 33 of 36),
    or the middle layer for a single tap. Tiny targets, where rounding repeats a layer, get it once."""
    num_taps = min(num_taps, num_target_layers)
    if num_taps == 1:
        return (num_target_layers // 2,)
    first, last = 1, max(1, num_target_layers - 3)
    spaced = (round(first + i * (last - first) / (num_taps - 1)) for i in range(num_taps))
    return tuple(dict.fromkeys(spaced))


def depth_bucket(depth: int, block_depth: int) -> int:
    """The logit rows a compiled draft computes for `depth`: the next power of two, at most the block's
    `block_depth` (1, 2, 4, 8, 15 for blocks of 16), so that a few graphs serve every budget."""
    return min(1 << max(depth - 1, 0).bit_length(), block_depth)


class Draft(NamedTuple):
    logits: torch.Tensor  # (B, D, V): marginals for positions anchor+1 .. anchor+D (D <= block_size - 1)
    hidden: torch.Tensor  # (B, block_size - 1, H): the final-normed states behind them (Weaver's prefix)
    # (V',) the draft vocabulary (ascending target ids) when the drafter has one: every other logit is the lowest
    # finite value, so the trees' top-k and normalisers may read these columns only (`proposable`)
    vocab: torch.Tensor | None = None


def proposable(draft_logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """draft_logits (..., V) restricted to the tokens the drafter can propose, its draft vocabulary `vocab`
    (`Draft.vocab`; None: all of them). Every other logit is the lowest finite value, probability 0, so the
    normalisers and top-k of the chain, the greedy trees and the adapter's pools are the same over these columns:
    6x fewer for SmolLM2's 8,192-token draft vocabulary (a log-softmax and top-k over 15 rows of 49,152 take
    0.9 ms on a 2-core Xeon, over 8,192 0.16 ms). `in_vocab` maps the indices they return to target ids."""
    return draft_logits if vocab is None else draft_logits[..., vocab]


def in_vocab(index: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Target token ids of indices into `proposable`'s columns."""
    return index if vocab is None else vocab[index]


@dataclass
class DrafterCache:
    """Projected context keys/values per drafter layer, grown as tokens are committed."""

    keys: list[torch.Tensor]  # (B, H_kv, max_len, D)
    values: list[torch.Tensor]
    length: int = 0


class DrafterAttention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q = Linear(cfg.hidden_size, H * D, bias=cfg.attention_bias)
        self.kv = Linear(cfg.hidden_size, 2 * Hkv * D, bias=cfg.attention_bias)
        self.o = Linear(H * D, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated keys and values (B, H_kv, T, D) of block tokens or context features."""
        B, T, _ = x.shape
        k, v = self.kv(x).view(B, T, 2, self.cfg.num_kv_heads, self.cfg.head_dim).unbind(2)
        return apply_rope(self.k_norm(k), cos, sin).transpose(1, 2), v.transpose(1, 2)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        k, v = self.keys_values(x, *rope)
        return self.attend(x, rope, torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2), mask)

    def attend(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Queries from x (B, Q, H) over given keys/values (B, H_kv, S, D), mask (B, 1, Q, S) bool."""
        B, Q, _ = x.shape
        H, D = self.cfg.num_heads, self.cfg.head_dim
        q = apply_rope(self.q_norm(self.q(x).view(B, Q, H, D)), *rope).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=k.shape[1] != H)
        return self.o(o.transpose(1, 2).reshape(B, Q, H * D))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DrafterAttention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context_kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), rope, context_kv, mask)
        return x + self.mlp(self.post_norm(x))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        body = cfg.body
        self.cfg = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * body.hidden_size, body.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(body.hidden_size, body.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(body) for _ in range(body.num_layers))
        self.norm = RMSNorm(body.hidden_size, body.rms_norm_eps)
        self.rotary = Rotary(body.inv_freq, body.rope_scaling)
        # target token ids the drafter proposes, ascending (a checkpoint tensor); None: all of them
        self.draft_vocab: torch.Tensor | None
        self.register_buffer("draft_vocab", None if cfg.draft_vocab_size is None
                             else torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self._head: tuple[torch.Tensor, torch.Tensor] | None = None  # (target lm_head weight, its draft rows), eval only
        self._compiled_block: dict[str, Callable[..., Draft]] = {}  # by inductor mode

    @property
    def dtype(self) -> torch.dtype:
        """The drafter's weights' dtype. At inference it may differ from the target's (`drafter.dtype`): the
        incremental drafting methods cast the target's tensors on the way in and the draft on the way out."""
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, self.dtype)

    def context(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """Fused context features: Linear(K*H -> H) then RMSNorm over the concatenated taps."""
        return self.hidden_norm(self.fc(torch.cat(taps, dim=-1)))

    def block_inputs(self, target: TargetModel, anchors: torch.Tensor) -> torch.Tensor:
        """Embeddings of [anchor, MASK x (B-1)] per anchor (N,) -> (N, B, H), via the target's embedding."""
        block = torch.full((len(anchors), self.cfg.block_size), self.cfg.mask_token_id, device=anchors.device)
        block[:, 0] = anchors
        return target.embed(block)

    def head(self, target: TargetModel) -> torch.Tensor:
        """The drafter's output projection (V', H): the target's lm_head rows of the draft vocabulary. The
        target is frozen, so outside training the slice is taken once per target, in the drafter's dtype
        (under autocast, which casts for the matmul itself, in the target's)."""
        weight = target.lm_head.weight
        if self.training:
            return weight if self.draft_vocab is None else weight[self.draft_vocab]
        dtype = weight.dtype if torch.is_autocast_enabled(weight.device.type) else self.dtype
        if self.draft_vocab is None and dtype == weight.dtype:
            return weight
        if self._head is None or self._head[0] is not weight or self._head[1].dtype != dtype:
            rows = weight if self.draft_vocab is None else weight[self.draft_vocab]
            self._head = (weight, rows.to(dtype))
        return self._head[1]

    def vocab_logits(self, target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (..., V') over the draft vocabulary (the whole target vocabulary without one)."""
        return linear(hidden, self.head(target))

    def logits(self, target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) over the target's vocabulary: tokens outside the draft vocabulary get the lowest
        finite value (probability 0, and finite, so the engine's overflow checks stay strict)."""
        logits = self.vocab_logits(target, hidden)
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], target.lm_head.weight.shape[0]), torch.finfo(logits.dtype).min)
        return full.index_copy(-1, self.draft_vocab, logits)

    def train(self, mode: bool = True) -> "Drafter":
        self._head = None
        return super().train(mode)

    def forward(
        self, block_embeds: torch.Tensor, block_positions: torch.Tensor, context: torch.Tensor,
        context_positions: torch.Tensor, mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Hidden states (B, Q, H) of block tokens attending to context features (B, C, H) and each other.

        mask (B, 1, Q, C + Q) bool, or None when every query may see every context and block key.
        """
        rope, ctx_rope = self.rope(block_positions), self.rope(context_positions)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, rope, layer.attn.keys_values(context, *ctx_rope), mask)
        return self.norm(x)

    # --- incremental drafting with a context cache (inference) ---

    def new_cache(self, batch_size: int, max_len: int) -> DrafterCache:
        body = self.cfg.body
        shape = (batch_size, body.num_kv_heads, max_len, body.head_dim)
        p = self.fc.weight
        return DrafterCache(
            [torch.zeros(shape, dtype=self.dtype, device=p.device) for _ in self.layers],
            [torch.zeros(shape, dtype=self.dtype, device=p.device) for _ in self.layers],
        )

    @exact_bf16(False)  # a draft only proposes: bf16's fast kernels (module docstring)
    def extend_context(self, cache: DrafterCache, taps: list[torch.Tensor], positions: torch.Tensor) -> None:
        """Append committed positions' tapped target states (B, n, H) to the drafter's context cache."""
        features = self.context([t.to(self.dtype) for t in taps])
        n = features.shape[1]
        if cache.length + n > cache.keys[0].shape[2]:
            raise WeaverError("drafter context cache overflow")
        cos, sin = self.rope(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.attn.keys_values(features, cos, sin)
            cache.keys[i][:, :, cache.length : cache.length + n] = k
            cache.values[i][:, :, cache.length : cache.length + n] = v
        cache.length += n

    @exact_bf16(False)
    def draft(self, target: TargetModel, cache: DrafterCache, anchor: torch.Tensor, anchor_position: torch.Tensor,
              max_depth: int | None = None, compiled: Compile = False) -> Draft:
        """The block for positions anchor+1 .. anchor+B-1 given the cached context.

        max_depth: logits for the first `max_depth` positions only (the lm_head over the block is most of a
        draft's cost; a tree of b nodes never reaches past depth b). The states cover the whole block.
        compiled: through torch.compile in that inductor mode, a graph per `depth_bucket` of logit rows (the
        extra rows are cut off here)."""
        depth = self.cfg.block_size - 1 if max_depth is None else min(max_depth, self.cfg.block_size - 1)
        if not compiled:
            return self.block(target, cache, anchor, anchor_position, depth)
        self.head(target)  # the draft vocabulary's head slice taken outside the graph
        rows = torch.empty(depth_bucket(depth, self.cfg.block_size - 1), 0)
        torch._dynamo.mark_static(rows)  # its length is the graph's static number of logit rows
        draft = self.block_compiled(compiled)(target, cache, anchor, anchor_position, rows)
        return Draft(draft.logits[:, :depth], draft.hidden, self.draft_vocab)

    def block(self, target: TargetModel, cache: DrafterCache, anchor: torch.Tensor, anchor_position: torch.Tensor,
              depth: int) -> Draft:
        x = self.block_inputs(target, anchor).to(self.dtype)
        positions = anchor_position[:, None] + torch.arange(self.cfg.block_size, device=x.device)
        rope = self.rope(positions)
        for i, layer in enumerate(self.layers):
            context_kv = (cache.keys[i][:, :, : cache.length], cache.values[i][:, :, : cache.length])
            x = layer(x, rope, context_kv, None)
        hidden = self.norm(x)[:, 1:]
        out = target.embed.weight.dtype  # the engine and the adapter read the draft in the target's dtype
        return Draft(self.logits(target, hidden[:, :depth]).to(out), hidden.to(out), self.draft_vocab)

    def block_compiled(self, compiled: Compile = True) -> Callable[..., Draft]:
        """`block` compiled once per drafter and inductor mode; the logit rows are the length of a static
        tensor, the context length dynamic. With "max-autotune" the lm_head over a few rows gets a GEMM
        kernel picked by measurement: ATen's costs 2-3x its one-row GEMV on an AVX2 CPU (docs/results.md)."""
        mode = inductor_mode(compiled)
        if mode not in self._compiled_block:
            graph = compile_step(lambda target, cache, anchor, anchor_position, rows: self.block(
                target, cache, anchor, anchor_position, rows.shape[0]), mode)
            self._compiled_block[mode] = graph
        return self._compiled_block[mode]

    @torch.inference_mode()
    def compile_draft(self, target: TargetModel, max_depths: set[int], compiled: Compile = True) -> None:
        """Build the compiled draft graphs for these max depths now, outside any timed loop (after a
        2-position context: dynamo specialises a length of 0 or 1)."""
        device = target.embed.weight.device
        cache = self.new_cache(1, 3)
        self.extend_context(cache, [torch.zeros(1, 2, self.cfg.body.hidden_size, device=device, dtype=self.dtype)]
                            * len(self.cfg.target_layer_ids), torch.arange(2, device=device)[None])
        anchor = torch.zeros(1, dtype=torch.long, device=device)
        for depth in sorted({depth_bucket(min(d, self.cfg.block_size - 1), self.cfg.block_size - 1) for d in max_depths}):
            self.draft(target, cache, anchor, torch.full((1,), 2, device=device), depth, compiled)


def check_pair(target: TargetModel, drafter: Drafter) -> None:
    """Refuse a drafter that does not fit the target, with one clear message."""
    t, d = target.cfg, drafter.cfg
    if d.body.hidden_size != t.hidden_size:
        raise WeaverError(f"drafter hidden size {d.body.hidden_size} does not match the target's {t.hidden_size}")
    if d.body.vocab_size not in (0, t.vocab_size):
        raise WeaverError(f"drafter vocab {d.body.vocab_size} does not match the target's {t.vocab_size}")
    if drafter.draft_vocab is not None and not bool(((drafter.draft_vocab >= 0) & (drafter.draft_vocab < t.vocab_size)).all()):
        raise WeaverError(f"drafter draft_vocab holds token ids outside the target vocab ({t.vocab_size})")
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise WeaverError(f"drafter mask_token_id {d.mask_token_id} is outside the target vocab ({t.vocab_size})")
    if len(set(d.target_layer_ids)) != len(d.target_layer_ids):
        raise WeaverError(f"drafter taps a target layer twice: {list(d.target_layer_ids)}")
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise WeaverError(f"drafter taps target layers {bad}, but the target has {t.num_layers} layers")
    if d.num_target_layers not in (None, t.num_layers):
        raise WeaverError(f"drafter was made for a target of {d.num_target_layers} layers (num_target_layers), "
                          f"this target has {t.num_layers}")
