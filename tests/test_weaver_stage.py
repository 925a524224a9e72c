"""The `weaver` training stage on the smoke models: a run killed after a checkpoint and resumed ends where
an uninterrupted run ends (same steps, same loss, same weights), with Muon + AdamW and bf16 autocast."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from hydra import compose, initialize_config_dir

import weaver.train.adapter as adapter_stage
from weaver.errors import WeaverError
from weaver.models.adapter import WeaverAdapter, load_adapter
from weaver.artifacts import load_drafter_for, load_target_and_tokenizer
from weaver.pipeline import ROOT_CONF, artifact_dir
from weaver.train.common import Checkpoints, split_heldout
from weaver.train.drafter import anchored_batches


def smoke_config(outputs: Path, *overrides: str):
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        return compose("train", overrides=[
            "+experiment=smoke", f"paths.root={outputs}", "wandb.enabled=false",
            "weaver.train.steps=8", "weaver.train.checkpoint_every=3", "weaver.train.log_every=1", *overrides,
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


def test_adapter_gradients_reproduce_bit_for_bit(smoke_outputs):
    """The same batch gives the same gradients on every backward: otherwise two identical runs (and a
    resumed run and an uninterrupted one) drift apart, Muon's orthogonalisation amplifying last-bit noise
    to 1e-3 in the weights. Pools share tokens across nodes, the case that made P's gradient vary with
    thread timing when it came from indexing a trainable table."""
    cfg = smoke_config(smoke_outputs)
    target, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, target)
    w = cfg.weaver
    adapter = WeaverAdapter(adapter_stage.adapter_config(w, target, drafter))
    torch.nn.init.normal_(adapter.query.weight, std=0.1)  # a trained Q: P gets a gradient
    rows = datasets.load_from_disk(str(artifact_dir(cfg, "rollouts") / "dataset"))
    ids, lengths, anchors, states = anchored_batches(tokenizer.pad_token_id or 0, w.train.anchors_per_seq, cfg.seed)(
        [rows[i] for i in range(8)])
    grads, threads = [], torch.get_num_threads()
    torch.set_num_threads(2)  # training's setting (the suite runs on one thread, where every order is the same)
    try:
        for _ in range(10):
            adapter.zero_grad()
            adapter_stage.adapter_loss(adapter, drafter, target, ids, lengths, anchors, w.train.loss, states)[0].backward()
            grads.append([p.grad.clone() for p in adapter.parameters()])
    finally:
        torch.set_num_threads(threads)
    for again in grads[1:]:
        for (name, _), a, b in zip(adapter.named_parameters(), grads[0], again):
            assert torch.equal(a, b), name


def test_read_text_is_labelled_with_the_targets_greedy_tokens(smoke_outputs):
    """Rows flagged as read text: every chain node's label is the target's argmax there, not the text's next
    token; the other rows keep their rollout's next token."""
    cfg = smoke_config(smoke_outputs)
    target, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, target)
    adapter = WeaverAdapter(adapter_stage.adapter_config(cfg.weaver, target, drafter))
    rows = datasets.load_from_disk(str(artifact_dir(cfg, "rollouts") / "dataset"))
    ids, lengths, anchors, _ = anchored_batches(tokenizer.pad_token_id or 0, 4, cfg.seed)([rows[i] for i in range(4)])
    ids = torch.randint(3, target.cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(0))  # not greedy text
    read = torch.tensor([True, False, True, False])
    chains = adapter_stage.score_chains(adapter, drafter, target, ids, lengths, anchors, read=read)
    labels = chains.labels.view(4, 4, -1)  # (rows, anchors, depth)
    with torch.no_grad():
        greedy = target(ids).logits.argmax(-1)
    D = labels.shape[-1]
    at = (anchors[:, :, None] + torch.arange(1, D + 1)).clamp(max=ids.shape[1] - 1)  # label positions
    rows_ = torch.arange(4)[:, None, None]
    assert torch.equal(labels[read], greedy[rows_, at - 1][read])
    assert torch.equal(labels[~read], ids[rows_, at][~read])
    assert not torch.equal(greedy[rows_, at - 1][read], ids[rows_, at][read])  # the flag made a difference


def test_pool_acceptance_is_what_rejection_sampling_accepts():
    """`accept` = sum min(p, q) over the pool, p the target's whole distribution: the rate at which one draft
    drawn from q passes the accept test u < p(x) / q(x) (Monte Carlo over 200k draws)."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(3, 50, generator=g) * 2
    pool = torch.stack([torch.randperm(50, generator=g)[:8] for _ in range(3)])
    log_q = (torch.randn(3, 8, generator=g) * 2).log_softmax(-1)
    accept = adapter_stage.pool_losses(log_q, teacher.log_softmax(-1).gather(-1, pool), pool, pool[:, 0])["accept"]
    p, q = teacher.softmax(-1).gather(-1, pool), log_q.exp()
    draws = torch.multinomial(q, 200_000, replacement=True, generator=g)
    passed = torch.rand(draws.shape, generator=g) < (p.gather(-1, draws) / q.gather(-1, draws))
    torch.testing.assert_close(accept, passed.float().mean(-1), atol=5e-3, rtol=0)
    assert (accept <= p.sum(-1) + 1e-6).all()  # the target's mass outside the pool is never accepted


def test_expected_chain_length_multiplies_acceptance_along_depths():
    accept = torch.tensor([[0.5, 0.5, 1.0], [0.8, 0.5, 0.5]])
    valid = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # the second rollout ends after depth 1
    torch.testing.assert_close(adapter_stage.expected_chain_length(accept, valid), torch.tensor([2.0, 1.8]))


def test_heldout_rollouts_are_not_trained_on_and_report_sampling_metrics(smoke_outputs, tmp_path, monkeypatch, capsys):
    """weaver.train.heldout_rollouts=8: training sees the other 40 rollouts, and the summary carries the
    adapter's metrics on the 8 held out (expected chain length under rejection sampling among them)."""
    seen = []
    real_loss = adapter_stage.adapter_loss

    def recording_loss(adapter, drafter, target, ids, *args, **kwargs):
        seen.append(ids.shape[0])
        return real_loss(adapter, drafter, target, ids, *args, **kwargs)

    monkeypatch.setattr(adapter_stage, "adapter_loss", recording_loss)
    cfg = smoke_config(smoke_outputs, "weaver.train.heldout_rollouts=8", "weaver.train.eval_every=4")
    summary = train(cfg, tmp_path / "a", tmp_path / "a.work")
    printed = capsys.readouterr().out
    assert "weaver step 4: heldout_tv " in printed and "weaver step 8: heldout_tv " in printed
    assert 1 <= summary["heldout_tau_rrs"] <= cfg.drafter.block_size and 0 <= summary["heldout_accept_d1"] <= 1
    assert summary["heldout_tau_rrs_prior"] >= 1 and "heldout_acc" in summary
    assert seen.count(8) == 8 + 2  # 8 training steps of batch 8, then 8 held-out rollouts at steps 4 and 8
    with pytest.raises(WeaverError, match="heldout_rollouts must be a whole number from 0 to 47"):
        train(smoke_config(smoke_outputs, "weaver.train.heldout_rollouts=48"), tmp_path / "b", tmp_path / "b.work")
    rows = datasets.Dataset.from_dict({"prompt_index": list(range(48))})
    trained, heldout = split_heldout(rows, 8, "weaver.train.heldout_rollouts")
    assert trained["prompt_index"] == list(range(40)) and heldout["prompt_index"] == list(range(40, 48))


def test_calibration_folds_the_scale_with_the_lowest_heldout_loss_into_the_query(smoke_outputs):
    """`calibrate_correction` picks the scale of lowest held-out loss and folds it into Q: the folded adapter's
    loss is the unfolded one's at that scale (scores = prior + scale x correction), the prior's own logits kept."""
    cfg = smoke_config(smoke_outputs)
    target, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, target)
    adapter = WeaverAdapter(adapter_stage.adapter_config(cfg.weaver, target, drafter)).eval()
    torch.nn.init.normal_(adapter.query.weight, std=0.1)
    rows = datasets.load_from_disk(str(artifact_dir(cfg, "rollouts") / "dataset"))
    batch = anchored_batches(tokenizer.pad_token_id or 0, 4, cfg.seed)([rows[i] for i in range(4)])
    ids, lengths, anchors, states = batch

    def loss(scale: float) -> torch.Tensor:
        with torch.no_grad():
            chains = adapter_stage.score_chains(adapter, drafter, target, ids, lengths, anchors, states)
            return adapter_stage.chain_loss(chains, cfg.weaver.train.loss, scale)[0]

    at = {scale: loss(scale) for scale in (0.0, 0.3, 1.0)}
    assert len({round(v.item(), 4) for v in at.values()}) == 3  # the scale matters
    scale, losses = adapter_stage.calibrate_correction(adapter, lambda s: (s - 0.3) ** 2)
    assert scale == 0.3 and losses[0.3] == min(losses.values()) and set(losses) == set(adapter_stage.CALIBRATION_SCALES)
    torch.testing.assert_close(loss(1.0), at[0.3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss(0.0), at[0.0], rtol=1e-5, atol=1e-6)


def test_calibrated_stage_records_its_scale_and_needs_heldout_rollouts(smoke_outputs, tmp_path, capsys):
    cfg = smoke_config(smoke_outputs, "weaver.train.heldout_rollouts=8", "weaver.train.calibrate=true")
    summary = train(cfg, tmp_path / "a", tmp_path / "a.work")
    assert summary["calibration_scale"] in adapter_stage.CALIBRATION_SCALES
    assert f"weaver: correction scaled by {summary['calibration_scale']:.1f} (held-out loss" in capsys.readouterr().out
    with pytest.raises(WeaverError, match=r"weaver.train.calibrate fits the adapter on held-out rollouts: set "
                                          r"weaver.train.heldout_rollouts > 0"):
        train(smoke_config(smoke_outputs, "weaver.train.calibrate=true"), tmp_path / "b", tmp_path / "b.work")
