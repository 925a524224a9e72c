"""Our own target-model forward pass (gpt-fast style): dense attention and hybrid Gated-DeltaNet models.

Why not transformers' modeling code: speculative decoding needs to control exactly what is written to
the cache (tree verification must leave the committed state untouched), needs tapped hidden states
for the drafter, and needs a fast batch-1 decode step. Weights load from HF checkpoints
(`weaver.models.checkpoint`); logits match transformers for the same weights (tests/test_target_equivalence.py).

Every layer reads the tokens of one forward call through a `Step` (`weaver.models.steps`): their positions
and the attention mask against the cache. A tree verification step (docs/method.md §2.5-2.6) carries the
tree and goes to each mixer's `forward_tree`, which only reads the committed cache; each mixer then commits
its own part of an accepted path (`commit`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weaver.kernels.dispatch import TreeInputError, use_triton
from weaver.kernels.gdn_tree import gdn_tree_commit_, gdn_tree_verify
from weaver.kernels.gdn_tree.reference import gdn_gates
from weaver.kernels.tree_attention import tree_attention
from weaver.kernels.tree_conv import conv_windows, tree_conv1d, tree_conv_commit_
from weaver.errors import WeaverError
from weaver.models.cache import ModelCache
from weaver.models.compile import Compile, compile_step, inductor_mode
from weaver.models.config import TargetConfig
from weaver.models.gdn import chunk_gated_delta_rule, gated_delta_step_
from weaver.models.layers import MLP, RMSNorm, Rotary, apply_rope, exact_inputs, exact_math, rms_norm
from weaver.models.linear import Linear, exact_bf16
from weaver.models.steps import GDNLayerPending, Pending, Step, TargetOutput
from weaver.tree import Tree


def verify_size(nodes: int) -> int:
    """The tree size a compiled verify pads `nodes` to: the next power of two, or one more (2, 3, 4, 5, 8, 9, 16,
    17, 32, 33, ...): a power-of-two budget plus its root, or a budget one under it, whose tree fills whole matmul
    calls (lossless bf16 runs every product in calls of 8, 16 or 32 rows, `weaver.models.linear.INVARIANT_ROWS`). So
    a few graphs serve every tree, and none pads past the rows it pays for. Never 1: dynamo specialises size 1."""
    power = 1 << max(nodes - 2, 0).bit_length()  # the least power of two >= nodes - 1
    return max(power if power >= nodes else power + 1, 2)


class Attention(nn.Module):
    """GQA attention with optional per-head q/k RMSNorm and sigmoid output gate; fused qkv projection."""

    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_width = H * D * (2 if cfg.attn_output_gate else 1)
        self.qkv = Linear(cfg.hidden_size, self.q_width + 2 * Hkv * D, bias=cfg.attention_bias)
        self.o = Linear(H * D, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, step: Step, cache: ModelCache | None) -> torch.Tensor:
        H, Hkv, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        q, k, v, gate = self.project(x, step, cache)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=step.attn_mask, is_causal=step.is_causal, scale=D**-0.5,
                                           enable_gqa=Hkv != H)
        return self.output(o, gate)

    def forward_tree(self, x: torch.Tensor, step: Step, cache: ModelCache) -> torch.Tensor:
        """Verify: each node attends to the committed context (valid slots) and its ancestors-or-self; its
        keys/values go to scratch slots that `commit` compacts."""
        q, k, v, gate = self.project(x, step, cache)
        o = tree_attention(q, k, v, step.tree, prefix_valid=cache.valid[:, : step.start],
                           scale=self.cfg.head_dim**-0.5, ancestors=step.ancestors)
        return self.output(o, gate)

    def project(self, x: torch.Tensor, step: Step, cache: ModelCache | None) -> tuple[torch.Tensor, ...]:
        """q (B, H, T, D) and, after the new tokens are written to the cache, k and v over every slot so far (in
        float64 under `exact_math`, or with a float64 cache (`new_cache`): the attention then rounds once, in
        `output`); the output gate (B, T, H*D) or None."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = self.qkv(x).split([self.q_width, Hkv * D, Hkv * D], dim=-1)
        gate = None
        if cfg.attn_output_gate:  # per head: [query | gate]
            q, gate = q.view(B, T, H, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(B, T, H * D)
        q, k, v = q.reshape(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            end = step.start + T
            cache.keys[self.layer][:, :, step.start : end] = k
            cache.values[self.layer][:, :, step.start : end] = v
            k, v = cache.keys[self.layer][:, :, :end], cache.values[self.layer][:, :, :end]
        return (*exact_inputs(q, k, v), gate)

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        B, _, T, _ = o.shape
        o = o.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate.to(o.dtype))
        if o.dtype == torch.float64:  # `exact_math` attention: rounded back to the (bf16) weights' dtype once
            o = o.to(self.o.weight.dtype)
        return self.o(o)

    def commit(self, cache: ModelCache, pending: Pending, path: torch.Tensor) -> None:
        """Move the accepted path's keys/values to consecutive slots after the context (`TargetModel.commit`
        skips it for a path of the tree's first nodes, already in place)."""
        start, n = pending.start, len(path)
        for kv in (cache.keys[self.layer], cache.values[self.layer]):
            kv[:, :, start : start + n] = kv[:, :, start + path]


class GatedDeltaNet(nn.Module):
    """Qwen3.5 GDN mixer: fused input projection, short causal conv, gated delta rule, gated RMSNorm."""

    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        self.value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        HV = cfg.linear_num_value_heads
        self.splits = [self.conv_dim, self.value_dim, HV, HV]  # [q k v | z | b | a]
        self.in_proj = Linear(cfg.hidden_size, sum(self.splits), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, cfg.linear_conv_kernel))
        self.A_log = nn.Parameter(torch.empty(HV).uniform_(0.01, 16).log())
        self.dt_bias = nn.Parameter(torch.ones(HV))
        self.norm_weight = nn.Parameter(torch.ones(cfg.linear_value_head_dim))
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)
        nn.init.kaiming_uniform_(self.conv_weight, a=5**0.5)

    def conv(self, mixed: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv + SiLU over (B, T, C), continuing from the last kernel-1 inputs `state`.

        Returns the outputs and the buffer cat(state, inputs) (B, C, K-1+T). Trees go through
        `weaver.kernels.tree_conv.tree_conv1d` instead.
        """
        B, T, C = mixed.shape
        K = self.conv_weight.shape[1]
        if state is None:
            state = mixed.new_zeros(B, C, K - 1)
        buffer = torch.cat([state, mixed.transpose(1, 2)], dim=-1)
        # K shifted multiply-adds: cheaper than conv1d on CPU, its backward far cheaper
        out = sum(buffer[..., j : j + T] * self.conv_weight[:, j, None] for j in range(K))
        return F.silu(out).transpose(1, 2), buffer

    def forward(self, x: torch.Tensor, step: Step, cache: ModelCache | None) -> torch.Tensor:
        T = x.shape[1]
        mixed, z, b, a = exact_inputs(*self.in_proj(x).split(self.splits, dim=-1))  # float64 under `exact_math`
        if step.token_mask is not None:  # left padding contributes nothing to conv or state
            mixed = mixed * step.token_mask[..., None].to(mixed.dtype)
        mixed, conv_buffer = self.conv(mixed, cache.conv[self.layer] if cache is not None else None)
        q, k, v = self.heads(mixed)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        if cache is None:
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
        elif T == 1:  # decode: update the cached state in place
            o = gated_delta_step_(q, k, v, g, beta, cache.recurrent[self.layer])
            cache.conv[self.layer].copy_(conv_buffer[..., 1:])
        else:
            o, new_state = chunk_gated_delta_rule(q, k, v, g, beta, cache.recurrent[self.layer])
            cache.conv[self.layer].copy_(conv_buffer[..., -(self.conv_weight.shape[1] - 1) :])
            cache.recurrent[self.layer].copy_(new_state)
        return self.output(o, z, x)

    def forward_tree(self, x: torch.Tensor, step: Step, cache: ModelCache) -> torch.Tensor:
        """Verify: every node continues its own path from the committed conv and GDN states, which are only
        read; what `commit` needs is left in `step.pending`. The tree kernels compute the gates themselves."""
        mixed, z, b, a = exact_inputs(*self.in_proj(x).split(self.splits, dim=-1))
        mixed, conv_pending = tree_conv1d(mixed, self.conv_weight, cache.conv[self.layer], step.tree,
                                          conv_index=step.conv_index)
        q, k, v = self.heads(mixed)
        o, gdn_pending = gdn_tree_verify(q, k, v, a, b, self.A_log, self.dt_bias, cache.recurrent[self.layer], step.tree,
                                         ancestors=step.ancestors)
        step.pending[self.layer] = GDNLayerPending(gdn_pending, conv_pending)
        return self.output(o, z, x)

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv outputs (B, T, C) as q, k (B, T, H, d_k) and v (B, T, HV, d_v)."""
        cfg, (B, T, _) = self.cfg, mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
                k.reshape(B, T, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
                v.reshape(B, T, cfg.linear_num_value_heads, cfg.linear_value_head_dim))

    def output(self, o: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm (fp32, float64 under `exact_math`) and the output projection, back in x's dtype."""
        B, T, _ = x.shape
        o = rms_norm(o, self.norm_weight, self.cfg.rms_norm_eps) * F.silu(z.view_as(o).to(o.dtype))
        return self.out_proj(o.to(x.dtype).reshape(B, T, self.value_dim))

    def commit(self, cache: ModelCache, pending: Pending, path: torch.Tensor) -> None:
        """Commit the accepted root-to-leaf path: one rank-|path| state update and the path's last conv
        inputs."""
        mine, leaf = pending.layers[self.layer], int(path[-1])
        gdn_tree_commit_(cache.recurrent[self.layer], mine.state, leaf)
        tree_conv_commit_(cache.conv[self.layer], mine.conv, leaf)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mixer = Attention(cfg, layer) if cfg.layer_types[layer] == "full_attention" else GatedDeltaNet(cfg, layer)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, step: Step, cache: ModelCache | None) -> torch.Tensor:
        h = self.input_norm(x)
        x = x + (self.mixer(h, step, cache) if step.tree is None else self.mixer.forward_tree(h, step, cache))
        return x + self.mlp(self.post_norm(x))


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(cfg.inv_freq, cfg.rope_scaling)
        for module in self.modules():  # bf16 verify passes bitwise equal to decoding (weaver.models.linear)
            if isinstance(module, Linear):
                module.row_invariant = True
        self._compiled_forward: dict[str, Callable[..., TargetOutput]] = {}  # by inductor mode
        self._compiled_tree_layers: dict[str, Callable[..., TargetOutput]] = {}

    def decode_fn(self, compiled: Compile = False) -> Callable[..., TargetOutput]:
        """The forward for single-token steps: eager, or compiled once per model and inductor mode.

        Batch-1 decode of a small model is dispatch-bound (about a thousand tiny ops per token); inductor
        fuses them, and "max-autotune" also picks each matmul's kernel. Compilation takes a minute or more
        on 2 CPU cores, so it pays off for long runs only.
        """
        if not compiled:
            return self.forward
        mode = inductor_mode(compiled)
        if mode not in self._compiled_forward:
            self._compiled_forward[mode] = compile_step(self.forward, mode)
        return self._compiled_forward[mode]

    def new_cache(self, batch_size: int, max_len: int) -> ModelCache:
        """Keys, values, conv windows and GDN states in float64 under `exact_math` (the layers read them in float64
        anyway; stored so, keys and values are converted once, when written, not at every step: ~7% of a SmolLM2 bf16
        decode), else in the weights' dtype (GDN states in fp32)."""
        p = self.embed.weight
        return ModelCache.empty(self.cfg, batch_size, max_len, p.dtype, p.device,
                                cache_dtype=torch.float64 if exact_math(p) else None)

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None, *,
                attention_mask: torch.Tensor | None = None, tap_layers: tuple[int, ...] = (),
                logits_to_keep: int | None = None) -> TargetOutput:
        """Run new tokens (B, T), appending them to `cache` if given.

        attention_mask (B, T): 1 for real tokens, 0 for left padding (first call on a cache only).
        logits_to_keep: compute logits for the last n positions only (0 = none, None = all).
        """
        step = self.plan_step(input_ids, cache, attention_mask)
        output = self.run_layers(input_ids, step, cache, tap_layers, logits_to_keep)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return output

    def prefill(self, input_ids: torch.Tensor, cache: ModelCache, *, attention_mask: torch.Tensor | None = None,
                tap_layers: tuple[int, ...] = ()) -> TargetOutput:
        """A prompt's forward (the first call on `cache`; logits of its last position), in bf16 on a CPU with the
        fast kernels (`exact_bf16(False)`: one matmul call per product), 1.4-2.5x faster than the exact path for
        32-256 tokens (`benchmarks/verify_cost.py --prefill`). Exactness is for the tokens that decoding and verification
        read in different shapes; every decoder (AR, speculative) reads a prompt through this one call, so their
        outputs still agree token for token."""
        with exact_bf16(False):
            return self(input_ids, cache, attention_mask=attention_mask, tap_layers=tap_layers, logits_to_keep=1)

    def verify(
        self, tree: Tree, cache: ModelCache, tap_layers: tuple[int, ...] = (), compiled: Compile = False,
        budget: int = 0,
    ) -> tuple[TargetOutput, Pending]:
        """Logits of every node of a draft tree (batch 1), each seeing the committed context plus its
        ancestors. Nothing is committed: attention KV goes to scratch slots past `cache.length` and
        GDN layers only read their state; `commit` then keeps the accepted path.

        compiled: run the layers through torch.compile in that mode (torch kernels only; with Triton the kernels are
        the fast path), the tree padded to `verify_size(max(len(tree), budget + 1))` nodes, so that a few
        graphs serve every tree, a search that stopped short of its `budget` included; the padding's
        scratch slots need room in the cache."""
        if cache.batch_size != 1:
            raise WeaverError("tree verification runs at batch 1")
        T, start = len(tree), cache.length
        run, padded = self.run_layers, tree
        torch_ops = not use_triton(self.embed.weight)
        if compiled and torch_ops:
            padded, run = tree.padded(verify_size(max(T, budget + 1))), self.tree_layers_compiled(compiled)
        cache.reserve(len(padded))
        positions = cache.next_position[:, None] + padded.depth[None]
        cos, sin = self.rope(positions)
        # attention layers mask by the tree themselves (`weaver.kernels.tree_attention`): valid context + ancestors;
        # the torch ops read the ancestors and conv windows built here, once for every layer
        conv_index = conv_windows(padded, self.cfg.linear_conv_kernel) if self.cfg.is_hybrid and torch_ops else None
        step = Step(positions, cos, sin, start, tree=padded, ancestors=padded.ancestors if torch_ops else None,
                    conv_index=conv_index)
        output = run(padded.tokens[None], step, cache, tap_layers, None)
        if len(padded) > T:  # drop the padding's outputs
            output = TargetOutput(output.logits[:, :T], output.hidden[:, :T], [t[:, :T] for t in output.taps])
        return output, Pending(tree, start, step.pending)

    @torch.inference_mode()
    def compile_verify(self, tree_sizes: set[int], tap_layers: tuple[int, ...] = (), compiled: Compile = True) -> None:
        """Build the compiled verify graphs for trees of these node counts now, outside any timed loop.
        After a 2-token context (dynamo specialises a cache start of 0 or 1; real steps start later) and with
        a spare slot (a tree that ends exactly at the cache's end would be specialised to that too)."""
        buckets = sorted({verify_size(n) for n in tree_sizes})
        cache = self.new_cache(1, 3 + max(buckets, default=0))
        self(torch.zeros(1, 2, dtype=torch.long, device=self.embed.weight.device), cache)
        for size in buckets:
            self.verify(Tree.chain(cache.next_position.new_zeros(size)), cache, tap_layers, compiled)

    def tree_layers_compiled(self, compiled: Compile = True) -> Callable[..., TargetOutput]:
        """`run_layers` for verify steps, compiled once per model and inductor mode: a graph per tree size
        (static: the tree's tensors are marked so), the cache length dynamic. A 5M model's verify is
        dispatch-bound (thousands of small ops per pass); inductor fuses them."""
        mode = inductor_mode(compiled)
        if mode not in self._compiled_tree_layers:
            graph = compile_step(self.run_layers, mode, fullgraph=True)

            def run(input_ids: torch.Tensor, step: Step, *args: Any) -> TargetOutput:
                for t in (input_ids, step.positions, step.cos, step.sin, step.ancestors, step.conv_index):
                    if t is not None:
                        torch._dynamo.mark_static(t)
                return graph(input_ids, step, *args)

            self._compiled_tree_layers[mode] = run
        return self._compiled_tree_layers[mode]

    def commit(self, cache: ModelCache, pending: Pending, leaf: int) -> None:
        """Commit the root-to-`leaf` path of a verified tree: compact its KV, update GDN states."""
        if not 0 <= leaf < len(pending.tree):
            raise TreeInputError(f"invalid tree input: leaf {leaf} of a verified tree of {len(pending.tree)} nodes")
        path = pending.tree.path_to(leaf)
        start, n = pending.start, len(path)
        # a path of the tree's first n nodes (nothing accepted, or the first branch) has its keys/values in place
        in_place = leaf == n - 1
        for layer in self.layers:
            if not (in_place and isinstance(layer.mixer, Attention)):
                layer.mixer.commit(cache, pending, path)
        cache.valid[:, start : start + n] = True
        cache.next_position = cache.next_position + n
        cache.length = start + n

    def run_layers(
        self, input_ids: torch.Tensor, step: Step, cache: ModelCache | None, tap_layers: tuple[int, ...],
        logits_to_keep: int | None,
    ) -> TargetOutput:
        x = self.embed(input_ids)
        taps: list = [None] * len(tap_layers)  # in the order asked for: the drafter's fc expects it
        for i, layer in enumerate(self.layers):
            x = layer(x, step, cache)
            for j, wanted in enumerate(tap_layers):  # not `i in tap_layers`: dynamo mistraces it
                if wanted == i:
                    taps[j] = x
        hidden = self.norm(x)
        logits = None
        if logits_to_keep != 0:
            logits = self.lm_head(hidden if logits_to_keep is None else hidden[:, -logits_to_keep:])
        return TargetOutput(logits, hidden, taps)

    def plan_step(self, input_ids: torch.Tensor, cache: ModelCache | None, attention_mask: torch.Tensor | None) -> Step:
        """Positions and attention mask of a causal append (and the cache book-keeping for it)."""
        B, T = input_ids.shape
        device = input_ids.device
        start = 0 if cache is None else cache.length
        if attention_mask is not None:
            if start:
                raise WeaverError("attention_mask (left padding) is only supported on the first call of a cache")
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
            if attention_mask.all():
                attention_mask = None
        if attention_mask is None:
            positions = torch.arange(T, device=device).expand(B, T)
            if cache is not None:
                positions = positions + cache.next_position[:, None]
        else:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        cos, sin = self.rope(positions)

        padded = attention_mask is not None or (cache is not None and cache.padded)
        if cache is not None:
            cache.reserve(T)
            cache.valid[:, start : start + T] = True if attention_mask is None else attention_mask
            cache.next_position = positions[:, -1] + 1
            cache.padded = padded
        if not padded and start == 0 and T > 1:
            return Step(positions, cos, sin, start, is_causal=True)  # prefill
        if not padded and T == 1:
            return Step(positions, cos, sin, start)  # decode: the one token sees every valid slot
        slots = torch.arange(start + T, device=device)
        causal = slots[None, :] <= (start + torch.arange(T, device=device))[:, None]  # (T, S)
        keys_valid = cache.valid[:, : start + T] if cache is not None else attention_mask
        mask = causal[None] if keys_valid is None else causal[None] & keys_valid[:, None, :]
        mask = mask | (slots[None, None, :] == start + torch.arange(T, device=device)[None, :, None])  # pads see self
        token_mask = attention_mask.to(self.embed.weight.dtype) if attention_mask is not None else None
        return Step(positions, cos, sin, start, attn_mask=mask[:, None], token_mask=token_mask)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, self.embed.weight.dtype)
