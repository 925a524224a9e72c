"""Named stages over one Hydra config; each stage's artifact is content-addressed and reused.

An artifact lives in `<paths.root>/artifacts/<stage>-<key>/`, where key hashes the config slice the
stage reads plus the keys of the stages it consumes: rerunning with the same config skips the stage,
changing e.g. the model width retrains the target and everything downstream. Training state of an
unfinished stage lives beside it in `<stage>-<key>.work/` (checkpoints), so a rerun resumes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from weaver.errors import WeaverError
from weaver.io import atomic_write_json


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise WeaverError(f"package '{name}' is not installed (scripts/install.sh installs it)")
    return str(Path(spec.origin).parent)


ROOT_CONF = Path(__file__).resolve().parents[1] / "conf"  # the Hydra config tree (editable install)

OmegaConf.register_new_resolver("pkg_dir", _package_dir, replace=True)


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]  # stages whose artifacts this one reads
    config: Callable[[DictConfig], list]  # the settings that determine the artifact (hashed into its key)
    run: Callable[[DictConfig, Path, Path], None]  # (cfg, out_dir, work_dir); must write out_dir atomically
    needed: Callable[[DictConfig], bool] = lambda cfg: True


def _run_corpus(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.data.corpus import build_corpus

    d = cfg.data
    build_corpus(list(d.sources), d.max_bytes, d.vocab_size, d.seq_len, d.val_fraction, cfg.seed, out_dir)


def _run_target(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.train.target import train_target

    train_target(cfg, artifact_dir(cfg, "corpus"), out_dir, work_dir)


def _run_rollouts(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.data.rollouts import corpus_prompts, generate_rollouts, set_prompts

    r = cfg.rollouts
    target, tokenizer = load_target_and_tokenizer(cfg)
    if r.prompts == "corpus":
        prompts = corpus_prompts(artifact_dir(cfg, "corpus"), r.n_prompts, r.prompt_tokens, cfg.seed)
    else:
        prompts = set_prompts(cfg, tokenizer)
    generate_rollouts(target, prompts, r, tokenizer.eos_token_id, cfg.seed, out_dir, work_dir)


def _rollout_settings(cfg: DictConfig) -> list:
    """What the rollouts depend on besides the target: their settings, the prompt sets, the chat template's."""
    r = cfg.rollouts
    sets = [] if r.prompts == "corpus" else [OmegaConf.to_container(cfg.prompt_sets[n]) for n in r.prompts if n in cfg.prompt_sets]
    return [_trained_on(cfg, "rollouts"), sets, OmegaConf.to_container(cfg.model.chat_template_kwargs), cfg.seed]


def _run_drafter(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.train.drafter import train_drafter

    target, tokenizer = load_target_and_tokenizer(cfg)
    train_drafter(cfg, target, tokenizer, artifact_dir(cfg, "rollouts"), out_dir, work_dir)


def _run_weaver(cfg: DictConfig, out_dir: Path, work_dir: Path) -> None:
    from weaver.train.adapter import train_adapter

    target, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, target)
    train_adapter(cfg, target, drafter, tokenizer, artifact_dir(cfg, "rollouts"), out_dir, work_dir)


def _scratch(cfg: DictConfig) -> bool:
    return cfg.model.source == "scratch"


# Settings read only when decoding: they must never change an artifact's key (and so never retrain).
INFERENCE_ONLY = {"model": ("dtype", "chat_template_kwargs"), "weaver": ("search",)}


def _trained_on(cfg: DictConfig, group: str) -> dict:
    """The config group `group` without its inference-only settings: what a training stage hashes."""
    settings = OmegaConf.to_container(cfg[group], resolve=True)
    return {k: v for k, v in settings.items() if k not in INFERENCE_ONLY.get(group, ())}


STAGES: dict[str, Stage] = {
    "corpus": Stage("corpus", (), lambda cfg: [_trained_on(cfg, "data"), cfg.seed], _run_corpus),
    "target": Stage(
        "target", ("corpus",), lambda cfg: [_trained_on(cfg, "model"), cfg.seed], _run_target, needed=_scratch,
    ),
    "rollouts": Stage("rollouts", ("target",), _rollout_settings, _run_rollouts),
    "drafter": Stage(
        "drafter", ("rollouts",), lambda cfg: [_trained_on(cfg, "drafter"), cfg.seed], _run_drafter,
        needed=lambda cfg: cfg.drafter.path is None,
    ),
    "weaver": Stage(
        "weaver", ("rollouts", "drafter"), lambda cfg: [_trained_on(cfg, "weaver"), cfg.seed], _run_weaver,
        needed=lambda cfg: cfg.weaver.path is None,
    ),
}


def stage_key(cfg: DictConfig, name: str) -> str:
    stage = STAGES[name]
    payload = {
        "stage": name,
        "config": stage.config(cfg),
        "inputs": [stage_key(cfg, up) for up in stage.inputs],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:10]


def artifact_dir(cfg: DictConfig, name: str) -> Path:
    return Path(cfg.paths.root) / "artifacts" / f"{name}-{stage_key(cfg, name)}"


NOTHING_TO_TRAIN = (
    "[{experiment}] nothing to train (stages: []). A pretrained target needs a DFlash drafter (drafter.path: a "
    "z-lab checkpoint folder or hub id) and, for the weaver method, an adapter (weaver.path); no experiment "
    "trains them on a pretrained target's rollouts yet. "
    "`python eval.py +experiment={experiment}` measures the methods these paths allow."
)


def run_stages(cfg: DictConfig) -> dict[str, str]:
    """Run cfg.stages in order (with their inputs first); returns {stage: artifact folder}."""
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise WeaverError(f"unknown stage(s) {unknown}; available: {', '.join(STAGES)}")
    if not cfg.stages:
        print(NOTHING_TO_TRAIN.format(experiment=cfg.experiment))
    done: dict[str, str] = {}
    for name in _with_inputs(list(cfg.stages)):
        stage = STAGES[name]
        if not stage.needed(cfg):
            print(f"[{name}] not needed with this config (pretrained model or checkpoint given)")
            continue
        out_dir = artifact_dir(cfg, name)
        if out_dir.exists():
            print(f"[{name}] up to date: {out_dir}")
        else:
            print(f"[{name}] building {out_dir}")
            work_dir = out_dir.with_name(out_dir.name + ".work")
            start = time.perf_counter()
            stage.run(cfg, out_dir, work_dir)
            shutil.rmtree(work_dir, ignore_errors=True)
            print(f"[{name}] built in {time.perf_counter() - start:.1f} s")
        done[name] = str(out_dir)
    atomic_write_json(Path(cfg.paths.root) / cfg.experiment / "artifacts.json", done)
    return done


def _with_inputs(names: list[str]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        for up in STAGES[name].inputs:
            visit(up)
        if name not in order:
            order.append(name)

    for name in names:
        visit(name)
    return order


def load_target_and_tokenizer(cfg: DictConfig):
    """The experiment's target model (on `cfg.device`, in `model.dtype`) and tokenizer: the trained
    artifact, an HF folder/hub id, or a GGUF."""
    from transformers import AutoTokenizer

    from weaver.models.checkpoint import load_target, resolve_checkpoint
    from weaver.precision import inference_dtype, resolve_device

    device = resolve_device(cfg.device)
    dtype = inference_dtype(cfg.model.dtype, device)
    if cfg.model.source == "scratch":
        folder = artifact_dir(cfg, "target")
        if not folder.exists():
            raise WeaverError(f"no trained target at {folder}; run `python train.py +experiment={cfg.experiment}` first")
    elif cfg.model.source == "hf":
        folder = resolve_checkpoint(cfg.model.path)
    elif cfg.model.source == "gguf":
        folder = gguf_as_safetensors(cfg)
    else:
        raise WeaverError(f"model.source must be scratch, hf or gguf, not '{cfg.model.source}'")
    return load_target(str(folder), dtype).to(device), AutoTokenizer.from_pretrained(folder)


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
    if not folder.exists():
        print(f"[gguf] dequantising {source} once into {folder}")
        model = load_target(cfg.model.path, torch.float32, gguf_file=cfg.model.gguf_file)
        hf_config = AutoConfig.from_pretrained(cfg.model.path, gguf_file=cfg.model.gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, gguf_file=cfg.model.gguf_file)
        save_hf_checkpoint(model, hf_config, folder, tokenizer)
    return folder


def _like(model, target):
    """`model` on the target's device and in its dtype: a bf16 target on a GPU gets a bf16 drafter there."""
    weight = target.embed.weight
    return model.to(device=weight.device, dtype=weight.dtype)


def load_drafter_for(cfg: DictConfig, target):
    """The experiment's drafter: a given DFlash checkpoint (cfg.drafter.path) or the trained artifact."""
    from weaver.models.drafter_checkpoint import load_drafter

    if cfg.drafter.path is not None:
        return _like(load_drafter(str(cfg.drafter.path), target), target)
    folder = artifact_dir(cfg, "drafter")
    if not folder.exists():
        raise WeaverError(f"no trained drafter at {folder}; run `python train.py +experiment={cfg.experiment}` first")
    return _like(load_drafter(str(folder), target), target)


def load_adapter_for(cfg: DictConfig, target, drafter):
    """The experiment's Weaver adapter: a given folder (cfg.weaver.path) or the trained artifact."""
    from weaver.models.adapter import load_adapter

    folder = Path(cfg.weaver.path) if cfg.weaver.path is not None else artifact_dir(cfg, "weaver")
    if not folder.exists():
        raise WeaverError(f"no trained Weaver adapter at {folder}; run `python train.py +experiment={cfg.experiment}` first")
    return _like(load_adapter(folder, target, drafter.cfg.block_size - 1), target)
