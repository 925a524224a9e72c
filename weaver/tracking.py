"""W&B settings shared by training and eval (conf/base.yaml `wandb:`): offline unless WANDB_MODE says
otherwise, runs under <paths.root>/wandb, so one `wandb sync <paths.root>/wandb/wandb/offline-run-*`
uploads both kinds of run."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


def tracking_enabled(cfg: DictConfig) -> bool:
    return bool(cfg.wandb.enabled and cfg.wandb.mode != "disabled")


def wandb_dir(cfg: DictConfig) -> Path:
    """Where W&B writes runs (created if needed)."""
    folder = Path(cfg.paths.root) / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
