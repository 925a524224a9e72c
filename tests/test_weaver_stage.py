"""The `weaver` training stage on the smoke models: a run killed after a checkpoint and resumed ends where
an uninterrupted run ends (same steps, same loss, same weights), with Muon + AdamW and bf16 autocast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import weaver.train.adapter as adapter_stage
from weaver.models.adapter import load_adapter
from weaver.pipeline import ROOT_CONF, artifact_dir, load_drafter_for, load_target_and_tokenizer
from weaver.train.common import Checkpoints


def smoke_config(outputs: Path):
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        return compose("train", overrides=[
            "+experiment=smoke", f"paths.root={outputs}", "wandb.enabled=false",
            "weaver.train.steps=8", "weaver.train.checkpoint_every=3", "weaver.train.log_every=1",
        ])


def train(cfg, out_dir: Path, work_dir: Path) -> dict:
    target, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, target)
    return adapter_stage.train_adapter(cfg, target, drafter, tokenizer, artifact_dir(cfg, "rollouts"), out_dir, work_dir)


def test_weaver_stage_resumes_after_a_crash(smoke_outputs, tmp_path, monkeypatch):
    cfg = smoke_config(smoke_outputs)
    reference = train(cfg, tmp_path / "a", tmp_path / "a.work")

    calls = []
    real_loss = adapter_stage.adapter_loss

    def crashing_loss(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # after the step-3 checkpoint
            raise KeyboardInterrupt("simulated crash")
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(adapter_stage, "adapter_loss", crashing_loss)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "b", tmp_path / "b.work")
    assert not (tmp_path / "b").exists()  # nothing half-written
    assert Checkpoints(tmp_path / "b.work" / "checkpoints").latest()[0] == 3
    monkeypatch.setattr(adapter_stage, "adapter_loss", real_loss)
    resumed = train(cfg, tmp_path / "b", tmp_path / "b.work")

    assert resumed["step"] == reference["step"] == 8
    assert resumed["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    target, _ = load_target_and_tokenizer(cfg)
    a, b = (load_adapter(tmp_path / x, target, cfg.drafter.block_size - 1) for x in "ab")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
