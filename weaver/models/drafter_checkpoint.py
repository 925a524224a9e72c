"""Drafters in z-lab's DFlash checkpoint format, in both directions.

Format: `config.json` is a Qwen3Config plus `block_size`, `num_target_layers` and
`dflash_config: {target_layer_ids, mask_token_id}`; `model.safetensors` holds `fc`, `hidden_norm`,
`norm` and `layers.N.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*` (no embedding or
lm_head: the target's are shared). Drafters trained here also record `tokenizer_sha256`, the fingerprint of
the target tokenizer they were trained with (`weaver.models.checkpoint.tokenizer_fingerprint`); z-lab's
checkpoints have none and load as before. A drafter with a reduced draft vocabulary records its size as
`draft_vocab_size` and its target token ids, ascending, as the int64 tensor `draft_vocab`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from weaver.errors import WeaverError
from weaver.io import atomic_dir
from weaver.models.checkpoint import check_tokenizer_fingerprint, load_hf_config, read_safetensors, resolve_checkpoint
from weaver.models.config import from_hf, is_count
from weaver.models.drafter import Drafter, DrafterConfig, check_pair, default_target_layers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from weaver.models.target import TargetModel


DEFAULT_ROPE_THETA = 1e6  # z-lab's drafters'


def new_drafter_config(
    target: TargetModel, num_layers: int, block_size: int, mask_token_id: int, num_taps: int = 5,
    target_layer_ids: tuple[int, ...] | None = None, intermediate_size: int | None = None,
    num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
    rope_theta: float = DEFAULT_ROPE_THETA, tokenizer_sha256: str | None = None, draft_vocab_size: int | None = None,
) -> Qwen3Config:
    """A DFlash-format config for a fresh drafter sized to `target` (hidden size and vocab are the target's);
    tokenizer_sha256: the fingerprint of the target's tokenizer, checked when the drafter is loaded;
    draft_vocab_size: the number of tokens it drafts from, None for the whole vocabulary."""
    t = target.cfg
    if not is_count(num_layers):
        raise WeaverError(f"drafter num_layers must be a whole number >= 1, got {num_layers!r}")
    if not is_count(block_size, 2):
        raise WeaverError(f"drafter block_size must be at least 2 (anchor + one draft), got {block_size!r}")
    if target_layer_ids is None and not is_count(num_taps):
        raise WeaverError(f"drafter num_taps must be a whole number >= 1, got {num_taps!r}")
    layers = target_layer_ids or default_target_layers(t.num_layers, num_taps)
    config = Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_hidden_layers=num_layers,
        intermediate_size=intermediate_size or t.intermediate_size, num_attention_heads=num_heads or t.num_heads,
        num_key_value_heads=num_kv_heads or t.num_kv_heads, head_dim=head_dim or t.head_dim,
        rms_norm_eps=t.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False, architectures=["DFlashDraftModel"],
        block_size=block_size, num_target_layers=t.num_layers,
        dflash_config={"target_layer_ids": list(layers), "mask_token_id": mask_token_id},
    )
    if tokenizer_sha256:
        config.tokenizer_sha256 = tokenizer_sha256
    if draft_vocab_size is not None:
        if not is_count(draft_vocab_size) or draft_vocab_size > t.vocab_size:
            raise WeaverError(f"drafter draft_vocab must be between 1 and the target's vocab ({t.vocab_size}), "
                              f"got {draft_vocab_size!r}")
        config.draft_vocab_size = draft_vocab_size
    return config


def drafter_config(hf: Qwen3Config) -> DrafterConfig:
    extra = getattr(hf, "dflash_config", None)
    if not isinstance(extra, dict) or "mask_token_id" not in extra or not hasattr(hf, "block_size"):
        raise WeaverError("not a DFlash drafter config: needs block_size and dflash_config.mask_token_id")
    block_size, mask = hf.block_size, extra["mask_token_id"]
    num_target_layers = getattr(hf, "num_target_layers", None)
    if not is_count(block_size, 2):
        raise WeaverError(f"drafter block_size must be at least 2 (anchor + one draft), got {block_size!r}")
    if not is_count(mask, 0):
        raise WeaverError(f"drafter dflash_config.mask_token_id must be a token id, got {mask!r}")
    if num_target_layers is not None and not is_count(num_target_layers):
        raise WeaverError(f"drafter num_target_layers must be a whole number >= 1, got {num_target_layers!r}")
    layers = extra.get("target_layer_ids")
    if layers is None:
        if num_target_layers is None:
            raise WeaverError("not a DFlash drafter config: needs dflash_config.target_layer_ids or num_target_layers")
        layers = default_target_layers(num_target_layers, hf.num_hidden_layers)
    if not isinstance(layers, (list, tuple)) or not layers or not all(is_count(i, 0) for i in layers):
        raise WeaverError(f"drafter dflash_config.target_layer_ids must be a non-empty list of layer indices, got {layers!r}")
    sha = getattr(hf, "tokenizer_sha256", None)
    draft_vocab_size = getattr(hf, "draft_vocab_size", None)
    if draft_vocab_size is not None and not is_count(draft_vocab_size):
        raise WeaverError(f"drafter draft_vocab_size must be a whole number >= 1, got {draft_vocab_size!r}")
    return DrafterConfig(from_hf(hf), int(block_size), tuple(int(i) for i in layers), int(mask),
                         int(num_target_layers) if num_target_layers is not None else None,
                         sha if isinstance(sha, str) and sha else None,
                         int(draft_vocab_size) if draft_vocab_size is not None else None)


def weight_table(cfg: DrafterConfig) -> list[tuple[str, list[str]]]:
    table = [("fc.weight", ["fc.weight"]), ("hidden_norm.weight", ["hidden_norm.weight"]), ("norm.weight", ["norm.weight"])]
    for i in range(cfg.body.num_layers):
        p, attn = f"layers.{i}.", f"layers.{i}.self_attn."
        table += [
            (p + "input_norm.weight", [p + "input_layernorm.weight"]),
            (p + "post_norm.weight", [p + "post_attention_layernorm.weight"]),
            (p + "attn.q.weight", [attn + "q_proj.weight"]),
            (p + "attn.kv.weight", [attn + "k_proj.weight", attn + "v_proj.weight"]),
            (p + "attn.o.weight", [attn + "o_proj.weight"]),
            (p + "attn.q_norm.weight", [attn + "q_norm.weight"]),
            (p + "attn.k_norm.weight", [attn + "k_norm.weight"]),
            (p + "mlp.gate_up.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            (p + "mlp.down.weight", [p + "mlp.down_proj.weight"]),
        ]
    return table


def checked_draft_vocab(ids: torch.Tensor | None, size: int) -> torch.Tensor:
    """The checkpoint's `draft_vocab`, refused unless it is `size` distinct ascending int64 token ids."""
    if ids is None:
        raise WeaverError("drafter checkpoint lacks draft_vocab (its config.json sets draft_vocab_size)")
    if ids.dtype != torch.int64 or ids.shape != (size,) or bool((ids.diff() <= 0).any()) or bool((ids < 0).any()):
        raise WeaverError(f"drafter draft_vocab must be {size} distinct ascending int64 token ids "
                          f"(draft_vocab_size), got {ids.dtype} of shape {tuple(ids.shape)}")
    return ids


def load_drafter(name_or_path: str, target: TargetModel | None = None, dtype: torch.dtype = torch.float32,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> Drafter:
    """Load a DFlash-format drafter; with `target`, refuse one that does not fit it: sizes, tapped layers, and
    (when the drafter records one) the tokenizer it was trained with, compared with `tokenizer` or else with
    the tokenizer saved beside the target (`weaver.models.checkpoint.target_tokenizer_sha256`)."""
    folder = resolve_checkpoint(name_or_path)
    cfg = drafter_config(load_hf_config(folder))
    tensors = read_safetensors(folder)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    state = {}
    for ours, names in weight_table(cfg):
        missing = [n for n in names if n not in tensors]
        if missing:
            raise WeaverError(f"drafter checkpoint lacks {missing[0]}")
        state[ours] = torch.cat([tensors[n] for n in names], dim=0)
    if cfg.draft_vocab_size is not None:
        state["draft_vocab"] = checked_draft_vocab(tensors.get("draft_vocab"), cfg.draft_vocab_size)
    drafter = Drafter(cfg)
    try:
        drafter.load_state_dict(state)
    except RuntimeError as err:
        raise WeaverError(f"drafter weights do not fit its config.json: {str(err).splitlines()[-1].strip()}") from None
    if target is not None:
        check_pair(target, drafter)
        check_tokenizer_fingerprint(f"the drafter at {name_or_path}", cfg.tokenizer_sha256, target, tokenizer)
    return drafter.to(dtype).eval()


def save_drafter(drafter: Drafter, hf_config: Qwen3Config, out_dir: Path) -> None:
    """Write config.json + model.safetensors in the DFlash format, atomically."""
    state = drafter.state_dict()
    tensors = {}
    for ours, names in weight_table(drafter.cfg):
        sizes = [len(state[ours]) // len(names)] * len(names)  # fused tensors are equal halves here
        for name, part in zip(names, state[ours].split(sizes)):
            tensors[name] = part.contiguous()
    if drafter.draft_vocab is not None:
        tensors["draft_vocab"] = drafter.draft_vocab.cpu().contiguous()
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in rope:  # top-level too: transformers 4.x readers (z-lab, SGLang) look there
        hf_config.rope_theta = rope["rope_theta"]
    with atomic_dir(out_dir) as tmp:
        hf_config.save_pretrained(tmp)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
