"""The training loop every stage shares: accelerate, warmup-stable-decay schedule, W&B, checkpoints, resume.

A stage supplies its model, dataset, collate function and loss; `fit` does the rest. Checkpoints are
accelerate states (safetensors weights, optimizer, scheduler, RNG) under `work_dir/checkpoints/step-N`,
written atomically; a rerun of the same stage resumes from the newest one and replays the same batches.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, RandomSampler
from tqdm.auto import tqdm

from weaver.errors import WeaverError
from weaver.io import atomic_dir, atomic_write_json, durable_rename, fsync_tree, writable_dir
from weaver.precision import resolve_device, training_precision
from weaver.tracking import tracking_enabled, wandb_dir

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]


def make_accelerator(cfg: DictConfig, run_name: str, precision: str = "auto") -> Accelerator:
    """Accelerator with W&B tracking (offline unless WANDB_MODE says otherwise) when enabled.

    `precision` is a stage's `train.precision`: bf16 | fp32 | auto (bf16 only where the hardware makes it
    fast, weaver/precision.py)."""
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-checkpoint INFO lines drown the bar
    tracking = tracking_enabled(cfg)
    # One process may train several stages with different precisions; accelerate keeps that setting in
    # a process-wide singleton, so clear it (the distributed set-up, PartialState, is kept).
    AcceleratorState._reset_state()
    precision = training_precision(precision, resolve_device(cfg.device))
    accelerator = Accelerator(
        mixed_precision={"bf16": "bf16"}.get(precision, "no"),
        cpu=cfg.device == "cpu",
        # schedules count optimizer steps; by default accelerate steps them once per process per step
        step_scheduler_with_optimizer=False,
        log_with="wandb" if tracking else None,
    )
    if tracking:
        accelerator.init_trackers(
            cfg.wandb.project,
            config=OmegaConf.to_container(cfg, resolve=True),
            init_kwargs={"wandb": {"mode": cfg.wandb.mode, "dir": str(wandb_dir(cfg)), "name": run_name}},
        )
    return accelerator


def wsd_multiplier(step: int, total: int, warmup: int, decay_fraction: float, min_ratio: float) -> float:
    """Warmup-stable-decay: linear warmup, flat, then linear decay to `min_ratio` over the last fraction."""
    if step < warmup:
        return (step + 1) / warmup
    decay_start = total - int(math.ceil(decay_fraction * total))
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
    return 1.0 - (1.0 - min_ratio) * progress


@dataclass
class Checkpoints:
    """Numbered accelerate states under `folder`; the newest `keep` are kept."""

    folder: Path
    keep: int = 2

    def all(self) -> list[tuple[int, Path]]:
        if not self.folder.exists():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name))]
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        found = self.all()
        return found[-1] if found else None

    def save(self, accelerator: Accelerator, step: int) -> None:
        """Every process writes its part (rank 0 the weights and optimizer, each rank its RNG state) into one
        temporary folder, which rank 0 renames once all are done: a checkpoint is complete or absent."""
        final = self.folder / f"step-{step:07d}"
        tmp = final.with_name(final.name + ".tmp")
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
            writable_dir(self.folder)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            fsync_tree(tmp)
            durable_rename(tmp, final)
            for _, old in self.all()[: -self.keep]:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()


def write_artifact(accelerator: Accelerator, save: Callable[[Path], None], out_dir: Path, summary: dict,
                   message: str) -> None:
    """Close the stage's trackers; rank 0 writes the artifact (`save` into a folder, then train_summary.json;
    the folder appears as `out_dir` only when both are on disk) and prints `message`, the other processes
    wait for it. (Not `end_training`: it also ends the process group, which the next stage of the same run
    still needs.)"""
    for tracker in accelerator.trackers:
        tracker.finish()
    if accelerator.is_main_process:
        with atomic_dir(out_dir) as tmp:
            save(tmp)
            atomic_write_json(tmp / "train_summary.json", summary)
        print(message)
    accelerator.wait_for_everyone()


class LossStep(torch.nn.Module):
    """A stage's `loss_fn(model, batch)` as one module's forward: distributed data parallel synchronises
    gradients of what runs inside a wrapped forward, and a loss may call several of the model's methods."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss_fn(self.model, batch)

    # checkpoints hold the model's own weights (no "model." prefix): the format fit wrote before this wrapper
    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict, assign)


def _batches(dataset: Dataset, batch_size: int, collate: Callable, seed: int, epoch: int) -> DataLoader:
    """One epoch of shuffled batches; the order depends only on (seed, epoch), so resume can replay it."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    sampler = RandomSampler(dataset, generator=generator)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True)


def split_heldout(rows: datasets.Dataset, n: int, setting: str) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(rows to train on, the last n rollouts held out, or None when n is 0); `setting` names n in the error."""
    if not isinstance(n, int) or not 0 <= n < len(rows):
        raise WeaverError(f"{setting} must be a whole number from 0 to {len(rows) - 1} "
                          f"(the rollouts: {len(rows)}), got {n!r}")
    if n == 0:
        return rows, None
    return rows.select(range(len(rows) - n)), rows.select(range(len(rows) - n, len(rows)))


def heldout_metrics(rows: datasets.Dataset, collate: Callable, loss_fn: LossFn, batch_size: int,
                    device: torch.device) -> Callable[[torch.nn.Module], dict[str, float]]:
    """evaluate(model) -> the loss function's metrics on held-out rollouts (means over their batches, prefixed
    `heldout_`): what τ is made of (top-1 per depth, acceptance) on data the model never saw."""
    batches = heldout_batches(rows, collate, batch_size, device)

    @torch.no_grad()
    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        logs = [loss_fn(model, batch)[1] for batch in batches]
        return {f"heldout_{k}": sum(log[k] for log in logs) / len(logs) for k in logs[0]}

    return evaluate


def heldout_batches(rows: datasets.Dataset, collate: Callable, batch_size: int, device: torch.device) -> list[tuple]:
    """The held-out rollouts collated once, in order, on `device`."""
    return [tuple(x.to(device) if torch.is_tensor(x) else x
                  for x in collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))]))
            for start in range(0, len(rows), batch_size)]


def fit(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    dataset: Dataset,
    collate: Callable,
    loss_fn: LossFn,
    train: DictConfig,
    work_dir: Path,
    seed: int,
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    desc: str = "train",
) -> dict[str, float]:
    """Train for `train.steps` optimizer steps, resuming from the newest checkpoint in work_dir.

    Several optimizers (e.g. Muon for matrices + AdamW for the rest) share one schedule shape."""
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: wsd_multiplier(s, train.steps, train.warmup_steps, train.decay_fraction, train.min_lr_ratio)
        )
        for o in optimizers
    ]
    step_fn, *prepared = accelerator.prepare(LossStep(model, loss_fn), *optimizers, *schedules)
    optimizers, schedules = prepared[: len(optimizers)], prepared[len(optimizers) :]
    checkpoints = Checkpoints(Path(work_dir) / "checkpoints")
    step = 0
    if (latest := checkpoints.latest()) is not None:
        step, path = latest
        accelerator.load_state(str(path))
        accelerator.print(f"resuming {desc} from {path} (step {step})")
    # train.batch_size is per process: with N processes a step sees N batches, an epoch has 1/N the steps
    steps_per_epoch = len(dataset) // (train.batch_size * accelerator.num_processes)
    if steps_per_epoch == 0:
        raise ValueError(f"dataset of {len(dataset)} rows is smaller than one batch of {train.batch_size} "
                         f"on each of {accelerator.num_processes} processes")
    if accelerator.num_processes > 1:
        accelerator.print(f"{desc}: {accelerator.num_processes} processes x batch {train.batch_size}, "
                          f"{steps_per_epoch} steps per epoch")
    metrics: dict[str, float] = {}
    bar = tqdm(total=train.steps, initial=step, desc=desc, disable=not accelerator.is_local_main_process)
    step_fn.train()
    while step < train.steps:
        epoch, offset = divmod(step, steps_per_epoch)
        loader = accelerator.prepare(_batches(dataset, train.batch_size, collate, seed, epoch))
        for batch in accelerator.skip_first_batches(loader, offset):
            with accelerator.autocast():
                loss, logs = step_fn(batch)
            accelerator.backward(loss)
            if train.grad_clip:
                accelerator.clip_grad_norm_(step_fn.parameters(), train.grad_clip)
            for o, schedule in zip(optimizers, schedules):
                o.step()
                schedule.step()
                o.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            metrics = {"loss": loss.item(), **logs, "lr": schedules[0].get_last_lr()[0]}
            if step % train.log_every == 0 or step == train.steps:
                bar.set_postfix({k: f"{v:.3g}" for k, v in metrics.items() if k != "lr"})
                accelerator.log(metrics, step=step)
            if evaluate is not None and ((train.eval_every and step % train.eval_every == 0) or step == train.steps):
                model.eval()
                with accelerator.autocast():
                    heldout = evaluate(model)
                model.train()
                metrics.update(heldout)
                accelerator.log(metrics, step=step)
                if accelerator.is_local_main_process:  # beside the bar: the curve that says whether to train longer
                    bar.write(f"{desc} step {step}: " + ", ".join(f"{k} {v:.3g}" for k, v in heldout.items()))
            if step % train.checkpoint_every == 0 or step == train.steps:
                checkpoints.save(accelerator, step)
            if step >= train.steps:
                break
    bar.close()
    model.eval()
    return {**metrics, "step": step}
