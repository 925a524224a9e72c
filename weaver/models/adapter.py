"""The Weaver adapter (docs/method.md §2.3): an autoregressive correction of the drafter's factorized marginals.

Per verify step, a prefix memory: slot 0 projects the target's final-norm hidden state of the token
before the anchor (the one whose logits chose the anchor), slots 1..D project the normed drafter states
at block positions 1..D. Each tree node is a token embedded with the target's frozen input embedding,
normed and projected to d_model. A small decoder stack (the drafter's layer: RoPE, qk-norm, SwiGLU) lets
every node attend to the whole prefix memory plus its ancestors-or-self. A node at depth d scores only the
candidates for depth d + 1, the drafter's top-M pool at block position d + 1:

    score(c) = drafter logit(c) + <P lm_head[c], Q out_norm(x)>        (softmax over the pool only)

so the drafter's marginal is the prior and the adapter learns the path-conditional correction without a
full-vocabulary projection. Q starts at zero: an untrained adapter reproduces the drafter (DDTree).

Positions: slot 0 at 0, slot d at d + 1, a node at depth k at k + 1 (aligned with the drafter slot that
predicted its token).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedTokenizerBase, Qwen3Config

from weaver.errors import WeaverError
from weaver.io import atomic_dir
from weaver.models.compile import Compile, compile_step, inductor_mode
from weaver.models.config import from_hf, is_count
from weaver.models.drafter import DrafterLayer, in_vocab
from weaver.models.layers import RMSNorm, Rotary
from weaver.models.linear import Linear

if TYPE_CHECKING:  # the drafting side runs without the target's verification kernels
    from weaver.models.target import TargetModel


@dataclass(frozen=True)
class AdapterConfig:
    target_hidden_size: int
    vocab_size: int
    max_depth: int  # D = drafter block_size - 1
    d_model: int = 256
    num_layers: int = 1
    num_heads: int = 4
    intermediate_size: int = 512
    rank: int = 64  # d_rank of the low-rank candidate scorer
    pool_size: int = 64  # M: candidates per depth, the drafter's top-M
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        """Sizes are whole numbers >= 1 (an adapter config comes from `weaver.*` settings or a config.json)."""
        for name in ("target_hidden_size", "vocab_size", "max_depth", "d_model", "num_layers", "num_heads",
                     "intermediate_size", "rank", "pool_size"):
            value = getattr(self, name)
            if not is_count(value):
                raise WeaverError(f"adapter {name} must be a whole number >= 1, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise WeaverError(f"adapter {name} must be a positive number, got {value!r}")

    def body(self) -> Qwen3Config:
        """The decoder stack as a Qwen3 config (the drafter's layer reads it)."""
        return Qwen3Config(
            vocab_size=self.vocab_size, hidden_size=self.d_model, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads, head_dim=self.d_model // self.num_heads,
            rms_norm_eps=self.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )


class AdapterCache:
    """Keys/values per layer: the prefix memory, then `capacity` node slots (a node's slot is its index in
    the tree under search, so attention masks are rows of the tree's ancestor matrix)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], capacity: int):
        self.prefix_len, self.length = keys[0].shape[2], 0
        empty = lambda t: t.new_zeros(*t.shape[:2], capacity, t.shape[3])  # noqa: E731
        self.keys = [torch.cat([k, empty(k)], dim=2) for k in keys]
        self.values = [torch.cat([v, empty(v)], dim=2) for v in values]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put new nodes' keys/values (N, H, T, d) at node slots (T,); all of the layer's keys/values.
        Out of place: training backpropagates through it."""
        self.keys[layer] = self.keys[layer].index_copy(2, self.prefix_len + slots, k)
        self.values[layer] = self.values[layer].index_copy(2, self.prefix_len + slots, v)
        return self.keys[layer], self.values[layer]


class WeaverAdapter(nn.Module):
    def __init__(self, cfg: AdapterConfig):
        super().__init__()
        if cfg.d_model % cfg.num_heads:
            raise WeaverError(f"adapter d_model {cfg.d_model} is not a multiple of num_heads {cfg.num_heads}")
        self.cfg = cfg
        body = from_hf(cfg.body())
        H, d = cfg.target_hidden_size, cfg.d_model
        self.target_in = Linear(H, d, bias=False)  # slot 0
        self.draft_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.draft_in = Linear(H, d, bias=False)  # slots 1..D
        self.token_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.token_in = Linear(H, d, bias=False)  # nodes
        self.layers = nn.ModuleList(DrafterLayer(body) for _ in range(cfg.num_layers))
        self.out_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.query = Linear(d, cfg.rank, bias=False)  # Q
        self.candidate = Linear(H, cfg.rank, bias=False)  # P, applied to lm_head rows
        self.rotary = Rotary(body.inv_freq)
        self._table: tuple[TargetModel, torch.Tensor] | None = None  # (target, P lm_head), eval mode only
        self._compiled_scorer: dict[str, Callable[..., torch.Tensor]] = {}  # by inductor mode
        self.tokenizer_sha256: str | None = None  # the target tokenizer it was trained with (saved, checked on load)
        self.reset_scorer()

    def reset_scorer(self) -> None:
        """Zero Q: the correction term vanishes and the adapter starts as the drafter's prior."""
        nn.init.zeros_(self.query.weight)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, self.token_in.weight.dtype)

    # --- inputs ---

    def prefix(self, target_hidden: torch.Tensor, draft_hidden: torch.Tensor) -> torch.Tensor:
        """(N, 1 + D, d_model) prefix memory from (N, H) target and (N, D, H) drafter states."""
        slot0 = self.target_in(target_hidden)[:, None]
        return torch.cat([slot0, self.draft_in(self.draft_norm(draft_hidden[:, : self.cfg.max_depth]))], dim=1)

    def node_inputs(self, target: TargetModel, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_in(self.token_norm(target.embed(tokens)))

    # --- the decoder over nodes ---

    def start(self, prefix: torch.Tensor, capacity: int) -> AdapterCache:
        """Project the prefix memory's keys/values once per step; room for `capacity` nodes after it."""
        rope = self.rope(torch.arange(prefix.shape[1], device=prefix.device)[None])
        kv = [layer.attn.keys_values(prefix, *rope) for layer in self.layers]
        return AdapterCache([k for k, _ in kv], [v for _, v in kv], capacity)

    def forward(self, x: torch.Tensor, depths: torch.Tensor, cache: AdapterCache, sees: torch.Tensor,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Out-normed states (N, T, d) of T new nodes, written to `cache` at `slots` (T,) (default: the
        next T slots).

        depths (N, T) or (T,); sees (N or 1, T, capacity) bool: which node slots each new node attends to
        (its ancestors and itself); every node sees the whole prefix.
        """
        rope = self.rope(depths + 1 if depths.dim() == 2 else (depths + 1)[None])
        N, T = x.shape[:2]
        if slots is None:
            slots = torch.arange(cache.length, cache.length + T, device=x.device)
            cache.length += T
        mask = torch.cat([sees.new_ones(sees.shape[0], T, cache.prefix_len), sees], dim=-1)[:, None]
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            k, v = cache.write(i, slots, *layer.attn.keys_values(h, *rope))
            x = x + layer.attn.attend(h, rope, k, v, mask)
            x = x + layer.mlp(layer.post_norm(x))
        return self.out_norm(x)

    def score_nodes(self, target: TargetModel, tokens: torch.Tensor, depths: torch.Tensor, sees: torch.Tensor,
                    slots: torch.Tensor, cache: AdapterCache, pool_logits: torch.Tensor, pool_candidates: torch.Tensor) -> torch.Tensor:
        """One search wave: pool scores (T, M) of T new tree nodes (tokens, depths, slots (T,); sees (T, capacity)),
        their keys/values written to `cache`; pool_logits (T, M) / pool_candidates (T, M, r) of their depths."""
        states = self(self.node_inputs(target, tokens)[None], depths, cache, sees[None], slots)[0]
        return self.pool_scores(states, pool_logits, pool_candidates)

    def scorer(self, compiled: Compile = False) -> Callable[..., torch.Tensor]:
        """`score_nodes`, eager or compiled once per adapter and inductor mode (dynamic shapes: one graph for
        every wave size and budget). A wave is about a hundred small ops, so compiling halves a Weaver
        search on a CPU."""
        if not compiled:
            return self.score_nodes
        mode = inductor_mode(compiled)
        if mode not in self._compiled_scorer:
            self._compiled_scorer[mode] = compile_step(self.score_nodes, mode)
        return self._compiled_scorer[mode]

    def pool_scores(self, states: torch.Tensor, pool_logits: torch.Tensor, pool_candidates: torch.Tensor) -> torch.Tensor:
        """Scores (..., M) of each node's pool: drafter logit + <P lm_head[c], Q state>.

        states (..., d); pool_logits (..., M) the drafter's logits of the pool; pool_candidates (..., M, r)
        = P lm_head[pool] (`pool_candidates`)."""
        return pool_logits.float() + (pool_candidates @ self.query(states)[..., None]).squeeze(-1).float()

    def pool_candidates(self, target: TargetModel, pool_tokens: torch.Tensor) -> torch.Tensor:
        """P lm_head[pool] (..., M, r) for pool_tokens (..., M). Both factors are frozen at inference, so an
        adapter in eval mode projects the whole vocabulary once per target and keeps that table (`train()`
        and `eval()` drop it). In training it projects the pool's rows only: the gradient of P is then one
        matmul, where indexing a trainable table would accumulate repeated rows in a thread-dependent order
        (CPU `index_put_`), and a run would not reproduce itself bit for bit."""
        if self.training:
            return self.candidate(target.lm_head.weight[pool_tokens])
        return self.candidate_table(target)[pool_tokens]

    def candidate_table(self, target: TargetModel) -> torch.Tensor:
        """P lm_head (V, r) over the whole vocabulary, projected once per target (eval mode)."""
        if self._table is None or self._table[0] is not target:
            self._table = (target, self.candidate(target.lm_head.weight))
        return self._table[1]

    def train(self, mode: bool = True) -> "WeaverAdapter":
        self._table = None
        return super().train(mode)


def with_pool(adapter: WeaverAdapter, pool_size: int | None) -> WeaverAdapter:
    """Have the adapter search the drafter's top `pool_size` candidates per depth instead of the pool it was
    trained on (None: keep its own); returns it. Its weights do not depend on the pool: a candidate's score
    is its drafter logit plus <P lm_head[c], Q x>, whatever the other candidates, so only the softmax's
    support changes."""
    if pool_size is None:
        return adapter
    if not is_count(pool_size):
        raise WeaverError(f"weaver.search.pool must be a whole number >= 1 or null (the adapter's own), "
                          f"got {pool_size!r}")
    adapter.cfg = replace(adapter.cfg, pool_size=pool_size)
    return adapter


def draft_pools(draft_logits: torch.Tensor, pool_size: int, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, tokens), each (..., D, M): the drafter's top-M candidates per block position. With a draft
    vocabulary `vocab`, draft_logits are over its columns only (`weaver.models.drafter.proposable`) and the
    tokens are mapped back to target ids."""
    logits, index = draft_logits.topk(min(pool_size, draft_logits.shape[-1]), dim=-1)
    return logits, in_vocab(index, vocab)


def save_adapter(adapter: WeaverAdapter, out_dir: Path, tokenizer_sha256: str | None = None) -> None:
    """config.json (AdapterConfig, and the fingerprint of the target tokenizer it was trained with:
    `tokenizer_sha256`, else the adapter's own) + model.safetensors, written atomically."""
    config = {"weaver_adapter": asdict(adapter.cfg)}
    sha = tokenizer_sha256 or adapter.tokenizer_sha256
    if sha:
        config["tokenizer_sha256"] = sha
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file({k: v.contiguous() for k, v in adapter.state_dict().items()}, tmp / "model.safetensors")


def check_adapter_fits(cfg: AdapterConfig, target: TargetModel, max_depth: int) -> None:
    """Refuse an adapter whose sizes do not fit the target (hidden size, vocabulary) or the drafter's block."""
    t = target.cfg
    if (cfg.target_hidden_size, cfg.vocab_size) != (t.hidden_size, t.vocab_size):
        raise WeaverError(
            f"adapter was trained for hidden size {cfg.target_hidden_size} / vocab {cfg.vocab_size}, "
            f"the target has {t.hidden_size} / {t.vocab_size}"
        )
    if cfg.max_depth != max_depth:
        raise WeaverError(f"adapter covers depth {cfg.max_depth}, the drafter drafts {max_depth} positions")


@contextlib.contextmanager
def _reading_adapter(folder: Path):
    """Turn what reading a broken or missing adapter folder raises into one WeaverError naming the folder."""
    try:
        yield
    except FileNotFoundError as e:
        raise WeaverError(f"no Weaver adapter at {folder}: {e.filename} is missing") from e
    except WeaverError as e:  # a size that is not a whole number >= 1
        raise WeaverError(f"{folder} is not a valid Weaver adapter checkpoint: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, OSError, SafetensorError) as e:
        raise WeaverError(f"{folder} is not a readable Weaver adapter checkpoint ({type(e).__name__}: {e})") from e


def read_adapter_config(folder: str | Path) -> tuple[AdapterConfig, str | None]:
    """A saved adapter's sizes and the fingerprint of its tokenizer (None if it records none), from its
    config.json alone: what a server checks its settings against before loading any weights."""
    folder = Path(folder)
    with _reading_adapter(folder):
        config = json.loads((folder / "config.json").read_text())
        sha = config.get("tokenizer_sha256")
        return AdapterConfig(**config["weaver_adapter"]), sha if isinstance(sha, str) else None


def load_adapter(folder: str | Path, target: TargetModel, max_depth: int,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> WeaverAdapter:
    """Read a saved adapter; refuse one whose sizes do not fit the target or the drafter's block, or (when
    it records one) that was trained with another tokenizer than `tokenizer` (default: the tokenizer saved
    beside the target, `weaver.models.checkpoint.target_tokenizer_sha256`)."""
    from weaver.models.checkpoint import check_tokenizer_fingerprint

    folder = Path(folder)
    cfg, sha = read_adapter_config(folder)
    with _reading_adapter(folder):
        state = load_file(folder / "model.safetensors")
    check_adapter_fits(cfg, target, max_depth)
    check_tokenizer_fingerprint(f"the Weaver adapter at {folder}", sha, target, tokenizer)
    adapter = WeaverAdapter(cfg)
    try:
        adapter.load_state_dict(state)
    except RuntimeError as e:
        raise WeaverError(f"adapter weights in {folder} do not match its config: {str(e).splitlines()[0]}") from e
    adapter.tokenizer_sha256 = sha
    return adapter.eval()


def expansion_batch(budget: int, calls: int = 16) -> int:
    """Frontier nodes expanded per adapter call: ceil(N / 16) by default (docs/method.md §2.4)."""
    return max(1, math.ceil(budget / calls))
