"""The experiment's models, loaded from its trained artifacts or from the checkpoints its config gives.

Every loader checks what it loads against what it will run with (a drafter against its target, an adapter
against both) and places it like the target (device, dtype).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from weaver.errors import WeaverError
from weaver.io import exclusive
from weaver.pipeline import artifact_dir, lock_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from weaver.models.adapter import WeaverAdapter
    from weaver.models.drafter import Drafter
    from weaver.models.target import TargetModel


def load_target_and_tokenizer(cfg: DictConfig,
                              data_setting: str = "model") -> tuple[TargetModel, PreTrainedTokenizerBase]:
    """The experiment's target model (on `cfg.device`, in `model.dtype`, or for the data stages in
    `rollouts.dtype` given as data_setting) and tokenizer: the trained artifact, an HF folder/hub id, or a GGUF."""
    from weaver.models.checkpoint import load_target, load_tokenizer
    from weaver.precision import data_dtype, resolve_device

    device = resolve_device(cfg.device)
    folder = target_folder(cfg)
    target = load_target(str(folder), data_dtype(data_setting, cfg.model.dtype, device)).to(device)
    return target, load_tokenizer(folder, target)  # refused if its ids do not fit the target's vocabulary


def target_folder(cfg: DictConfig) -> Path:
    """The target's HF-format folder: the trained artifact, a given folder or hub snapshot, or the cached GGUF."""
    from weaver.models.checkpoint import resolve_checkpoint

    if cfg.model.source == "scratch":
        folder = artifact_dir(cfg, "target")
        if not folder.exists():
            raise WeaverError(f"no trained target at {folder}; run `python train.py +experiment={cfg.experiment}` first")
        return folder
    if cfg.model.source == "hf":
        return resolve_checkpoint(cfg.model.path)
    if cfg.model.source == "gguf":
        return gguf_as_safetensors(cfg)
    raise WeaverError(f"model.source must be scratch, hf or gguf, not '{cfg.model.source}'")


def gguf_as_safetensors(cfg: DictConfig) -> Path:
    """The GGUF target dequantised once into an HF safetensors folder under `artifacts/gguf-<key>/` (key: the
    file's path, size and mtime): dequantising takes most of a minute, reading safetensors a second."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from weaver.models.checkpoint import load_target, save_hf_checkpoint

    source = Path(cfg.model.path) / cfg.model.gguf_file
    if not source.is_file():
        raise WeaverError(f"GGUF file not found: {source}")
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    folder = Path(cfg.paths.root) / "artifacts" / f"gguf-{key}"
    with exclusive(lock_file(folder)):
        if not folder.exists():
            print(f"[gguf] dequantising {source} once into {folder}")
            model = load_target(cfg.model.path, torch.float32, gguf_file=cfg.model.gguf_file)
            hf_config = AutoConfig.from_pretrained(cfg.model.path, gguf_file=cfg.model.gguf_file)
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, gguf_file=cfg.model.gguf_file)
            save_hf_checkpoint(model, hf_config, folder, tokenizer)
    return folder


def _like(model, target):
    """`model` on the target's device and in its dtype: a bf16 target on a GPU gets a bf16 adapter there."""
    weight = target.embed.weight
    return model.to(device=weight.device, dtype=weight.dtype)


def drafter_folder(cfg: DictConfig) -> Path:
    """The experiment's drafter checkpoint: a given DFlash folder or hub snapshot (cfg.drafter.path), or the
    trained artifact."""
    from weaver.models.checkpoint import resolve_checkpoint

    if cfg.drafter.path is not None:
        if cfg.drafter.get("draft_vocab") is not None:
            raise WeaverError("drafter.draft_vocab applies to drafters trained here; a given drafter (drafter.path) "
                              "drafts from the vocabulary its checkpoint records")
        return resolve_checkpoint(str(cfg.drafter.path))
    folder = artifact_dir(cfg, "drafter")
    if not folder.exists():
        raise WeaverError(f"no trained drafter at {folder}; run `python train.py +experiment={cfg.experiment}` first")
    return folder


def load_drafter_for(cfg: DictConfig, target: TargetModel, setting: str | None = None) -> Drafter:
    """The experiment's drafter (`drafter_folder`), checked against the target, on its device, in the dtype
    `setting` (default: `drafter.dtype`) resolves to (`weaver.precision.drafter_dtype`). What trains on a drafter
    passes "model": `drafter.dtype` is an inference setting and never enters an artifact's key."""
    from weaver.models.drafter_checkpoint import load_drafter
    from weaver.precision import drafter_dtype

    weight = target.embed.weight
    dtype = drafter_dtype(setting or cfg.drafter.dtype, weight.dtype, weight.device)
    return load_drafter(str(drafter_folder(cfg)), target).to(device=weight.device, dtype=dtype)


def adapter_folder(cfg: DictConfig) -> Path:
    """The experiment's Weaver adapter: a given folder (cfg.weaver.path) or the trained artifact."""
    folder = Path(cfg.weaver.path) if cfg.weaver.path is not None else artifact_dir(cfg, "weaver")
    if not folder.exists():
        raise WeaverError(f"no trained Weaver adapter at {folder}; run `python train.py +experiment={cfg.experiment}` first")
    return folder


def load_adapter_for(cfg: DictConfig, target: TargetModel, drafter: Drafter) -> WeaverAdapter:
    """The experiment's Weaver adapter (`adapter_folder`), checked against the target and drafter, searching
    the pool `weaver.search.pool` (null: the one it was trained on)."""
    from weaver.models.adapter import load_adapter, with_pool

    adapter = load_adapter(adapter_folder(cfg), target, drafter.cfg.block_size - 1)
    return _like(with_pool(adapter, cfg.weaver.search.pool), target)
