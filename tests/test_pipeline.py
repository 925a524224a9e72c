"""The Hydra pipeline end to end at smoke size, stage reuse, resume, and clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from hf_tiny import VOCAB
from weaver.models.checkpoint import load_target
from weaver.train.common import Checkpoints, fit, make_accelerator

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, outputs: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WEAVER_OUTPUTS": str(outputs), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, script, *overrides], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def smoke(smoke_outputs) -> Path:
    return smoke_outputs  # trained once per session (tests/conftest.py), shared with the eval and notebook tests


def test_smoke_pipeline_writes_a_transformers_checkpoint(smoke):
    artifacts = json.loads((smoke / "smoke" / "artifacts.json").read_text())
    target = Path(artifacts["target"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "train_summary.json"} <= {p.name for p in target.iterdir()}
    assert (Path(artifacts["rollouts"]) / "dataset").is_dir() and (Path(artifacts["drafter"]) / "config.json").exists()
    summary = json.loads((target / "train_summary.json").read_text())
    assert summary["step"] == 40 and summary["loss"] < 6.0  # ln(512) = 6.24 at random init
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = torch.randint(0, 512, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(load_target(str(target))(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)
    assert not list((smoke / "artifacts").glob("*.work")), "work folders are removed once a stage is done"


def test_rerun_reuses_artifacts(smoke):
    again = run("train.py", smoke, "+experiment=smoke")
    assert again.returncode == 0
    for stage in ("corpus", "target", "rollouts", "drafter"):
        assert f"[{stage}] up to date" in again.stdout


def test_a_run_of_some_stages_keeps_the_others_in_the_record(smoke, tmp_path):
    """`stages=[rollouts]` after a full run: artifacts.json (what `artifact_of` reads) still lists every stage's
    artifact of this config, the drafter and adapter among them, not only the stage run."""
    shutil.copytree(smoke / "artifacts", tmp_path / "artifacts")
    done = run("train.py", tmp_path, "+experiment=smoke", "stages=[rollouts]")
    assert done.returncode == 0, done.stderr[-3000:]
    full = json.loads((smoke / "smoke" / "artifacts.json").read_text())
    record = json.loads((tmp_path / "smoke" / "artifacts.json").read_text())
    assert {"drafter", "weaver"} <= set(full)
    assert {k: Path(v).name for k, v in record.items()} == {k: Path(v).name for k, v in full.items()}


def test_rollouts_dtype_makes_new_data_in_that_dtype(smoke, tmp_path):
    """`rollouts.dtype` loads the target for the data stages in that dtype; bf16 rollouts are other data (a new key)."""
    shutil.copytree(smoke / "artifacts", tmp_path / "artifacts")  # the trained corpus and target, reused
    done = run("train.py", tmp_path, "+experiment=smoke", "stages=[rollouts]", "rollouts.dtype=bfloat16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[target] up to date" in done.stdout
    built = Path(json.loads((tmp_path / "smoke" / "artifacts.json").read_text())["rollouts"])
    assert f"[rollouts] building {built}" in done.stdout
    assert json.loads((built / "stats.json").read_text())["dtype"] == "bfloat16"
    default = Path(json.loads((smoke / "smoke" / "artifacts.json").read_text())["rollouts"])
    assert built.name != default.name and json.loads((default / "stats.json").read_text())["dtype"] == "float32"


def test_a_draft_vocabulary_drafter_trains_and_decodes_losslessly(smoke, tmp_path):
    """`drafter.draft_vocab: n` trains a new drafter (and adapter) on the same rollouts that drafts from the n most
    frequent response tokens; the eval decodes with it and every row equals AR decoding."""
    shutil.copytree(smoke / "artifacts", tmp_path / "artifacts")
    done = run("train.py", tmp_path, "+experiment=smoke", "drafter.draft_vocab=96")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rollouts] up to date" in done.stdout
    built = Path(json.loads((tmp_path / "smoke" / "artifacts.json").read_text())["drafter"])
    assert f"[drafter] building {built}" in done.stdout
    assert json.loads((built / "config.json").read_text())["draft_vocab_size"] == 96
    out_dir = tmp_path / "eval"
    done = run("eval.py", tmp_path, "+experiment=smoke", "drafter.draft_vocab=96", f"eval.out_dir={out_dir}",
               "eval.datasets=[heldout_code]", "eval.methods=[ar,chain,weaver]")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"ar", "chain", "weaver"}
    assert all(r["greedy_match"] for r in rows if r["method"] != "ar")


def test_a_drafter_and_adapter_read_text_beside_their_rollouts(smoke, tmp_path):
    """`drafter.text.sources` lets the target read corpus windows (stage `text`, stored states) and the drafter
    (and, with `weaver.train.read_text`, the adapter) trains on them beside the rollouts; speculative decoding
    stays equal to AR decoding."""
    shutil.copytree(smoke / "artifacts", tmp_path / "artifacts")
    text = ["rollouts.store_states=true", "drafter.text.sources=[python_stdlib]", "drafter.text.n_sequences=24",
            "drafter.text.seq_len=48", "weaver.train.read_text=true"]
    done = run("train.py", tmp_path, "+experiment=smoke", *text)
    assert done.returncode == 0, done.stderr[-3000:]
    artifacts = json.loads((tmp_path / "smoke" / "artifacts.json").read_text())
    assert f"[text] building {artifacts['text']}" in done.stdout and "[rollouts] up to date" in done.stdout
    assert "48 rollouts + 24 read texts" in done.stdout and "pool 16, 48 rollouts + 24 read texts" in done.stdout
    assert {p.name for p in Path(artifacts["text"]).iterdir()} == {"dataset", "states"}
    out_dir = tmp_path / "eval"
    done = run("eval.py", tmp_path, "+experiment=smoke", *text, f"eval.out_dir={out_dir}",
               "eval.datasets=[heldout_code]", "eval.methods=[ar,chain,weaver]")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
    assert all(r["greedy_match"] for r in rows if r["method"] != "ar")
    refused = run("train.py", tmp_path, "+experiment=smoke", *text[1:], "stages=[drafter]")
    assert refused.returncode == 2 and "needs stored rollout states (rollouts.store_states: true)" in refused.stderr
    refused = run("train.py", tmp_path, "+experiment=smoke", "weaver.train.read_text=true", "stages=[weaver]")
    assert refused.returncode == 2 and "weaver.train.read_text needs the text the target read" in refused.stderr


def test_eval_writes_result_rows(smoke_eval):
    rows = {(r["dataset"], r["method"], r["budget"]): r for r in map(json.loads, (smoke_eval / "results.jsonl").read_text().splitlines())}
    assert {d for d, _, _ in rows} == {"heldout_code", "humaneval", "gsm_symbolic"}
    ar = rows["humaneval", "ar", None]
    assert ar["n_tokens"] > 0 and ar["tokens_per_s"] > 0 and ar["tau"] == 1.0 and ar["n_prompts"] == 2
    chain = rows["heldout_code", "chain", 7]  # the drafter trained by the smoke pipeline, verified losslessly
    assert chain["greedy_match"] is True and chain["tau"] >= 1.0 and chain["speedup_vs_ar"] > 0
    assert sum(chain["accept_hist"]) > 0 and 0 < chain["draft_share"] < 1 and 0 < chain["verify_share"] < 1
    assert 0 < chain["prefill_share"] < 1  # the prompt's read, timed apart from the steps
    split = [chain[f"{phase}_share"] for phase in ("prefill", "draft", "search", "verify", "accept", "commit", "other")]
    assert all(0 <= share < 1 for share in split[:-1]) and sum(split) == pytest.approx(1)
    assert all(r["greedy_match"] for r in rows.values())  # every builder and budget reproduces AR greedy
    assert {("ddtree", 2), ("ddtree", 4), ("ddtree", "auto"), ("weaver", "auto"), ("chain", "auto")} <= {(m, b) for _, m, b in rows}
    auto = rows["heldout_code", "weaver", "auto"]  # each step's budget chosen among the smoke candidates 1, 2, 4
    assert 1 <= auto["mean_budget"] <= 4 and auto["tau"] >= 1
    for name in ("tau_vs_budget.png", "speedup.png", "acceptance.png", "summary.csv", "summary.md"):
        assert (smoke_eval / name).stat().st_size > 0
    assert "| macro | ddtree | 4 |" in (smoke_eval / "summary.md").read_text()


@pytest.mark.parametrize(
    "script,overrides,message",
    [
        ("eval.py", ["+experiment=smoke", "model.hf_config.hidden_size=48"], "no trained target"),
        ("eval.py", ["+experiment=smoke", "eval.methods=[nope]"], "unknown method/dataset ['nope']"),
        ("eval.py", ["+experiment=smoke", "eval.datasets=[humaneval,nope]"], "unknown method/dataset ['nope']"),
        ("train.py", ["+experiment=smoke", "stages=[nope]"], "unknown stage(s) ['nope']"),
        ("train.py", ["+experiment=smoke", "model.hf_config.hidden_size=abc"], "invalid model.hf_config"),
        ("eval.py", ["+experiment=smoke", "drafter.path=/no/such/drafter", "drafter.draft_vocab=64"],
         "drafter.draft_vocab applies to drafters trained here"),
        ("eval.py", ["+experiment=smoke", "model=qwen3_8b", "model.path=/no/such/folder", "eval.datasets=[humaneval]"],
         "checkpoint folder not found"),
        ("eval.py", ["+experiment=smoke", "drafter.path=${artifact_of:nope,drafter}"], "no artifacts of experiment 'nope'"),
        ("eval.py", ["+experiment=smoke", "drafter.path=${artifact_of:smoke,nope}"], "experiment 'smoke' built no nope"),
    ],
)
def test_bad_input_is_one_clear_line(smoke, script, overrides, message):
    done = run(script, smoke, *overrides)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in done.stderr and "Traceback" not in done.stderr


def test_an_experiment_reads_another_experiments_artifact(tmp_path):
    """`${artifact_of:experiment,stage}`: the folder that experiment's last training run recorded for the stage."""
    import weaver.pipeline  # noqa: F401  (registers the resolver)

    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "artifacts.json").write_text(json.dumps({"drafter": "/a/drafter-123"}))
    cfg = OmegaConf.create({"paths": {"root": str(tmp_path)}, "drafter": {"path": "${artifact_of:first,drafter}"}})
    assert cfg.drafter.path == "/a/drafter-123"


def test_unwritable_results_folder(smoke, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be created below a file, even by root
    done = run("eval.py", smoke, "+experiment=smoke", f"eval.out_dir={blocker}/sub")
    assert done.returncode == 2 and "output folder is not writable" in done.stderr


def _toy_fit(work_dir: Path, steps: int, crash_at: int | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    data = torch.randint(0, VOCAB, (64, 9))
    train = OmegaConf.create(dict(steps=steps, batch_size=8, warmup_steps=2, decay_fraction=0.3, min_lr_ratio=0.1,
                                  grad_clip=1.0, log_every=1, eval_every=100, checkpoint_every=3))
    cfg = OmegaConf.create(dict(wandb=dict(enabled=False, mode="disabled"), device="cpu", paths=dict(root=str(work_dir))))
    seen = []

    def loss_fn(m, batch):
        seen.append(1)
        if crash_at is not None and len(seen) == crash_at:
            raise KeyboardInterrupt("simulated crash")
        logits = m(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()), {}

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fit(make_accelerator(cfg, "toy"), model, optimizer, list(data), torch.stack, loss_fn, train, work_dir, seed=0)
    return model


def test_resume_after_crash_matches_uninterrupted(tmp_path):
    reference = _toy_fit(tmp_path / "a", steps=14)
    with pytest.raises(KeyboardInterrupt):
        _toy_fit(tmp_path / "b", steps=14, crash_at=11)  # dies after the step-9 checkpoint
    assert Checkpoints(tmp_path / "b" / "checkpoints").latest()[0] == 9
    resumed = _toy_fit(tmp_path / "b", steps=14)
    for p, q in zip(reference.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_gpu_recipe_runs_from_local_snapshots(smoke, tmp_path):
    """`+experiment=qwen3_8b` (a hub target with z-lab's DFlash drafter) with both pointed at local folders of
    the same formats: rollouts from prompt sets, an adapter trained beside the given drafter, then eval."""
    built = json.loads((smoke / "smoke" / "artifacts.json").read_text())
    target, drafter = built["target"], built["drafter"]
    given = [f"model.path={target}", f"drafter.path={drafter}", "model.dtype=float32", "device=cpu"]
    small = ["rollouts.prompts=[train_math]", "rollouts.n_prompts=8", "rollouts.prompt_tokens=32",
             "rollouts.max_new_tokens=16", "rollouts.batch_size=4", "rollouts.shard_size=8", "weaver.train.steps=4",
             "weaver.train.batch_size=2", "weaver.train.precision=fp32", "weaver.d_model=32", "weaver.num_heads=2",
             "weaver.intermediate_size=64", "weaver.rank=16", "weaver.pool_size=16"]
    done = run("train.py", tmp_path, "+experiment=qwen3_8b", *given, *small)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[drafter] not needed" in done.stdout
    built = json.loads((tmp_path / "qwen3_8b" / "artifacts.json").read_text())
    assert set(built) == {"rollouts", "weaver"}
    done = run("eval.py", tmp_path, "+experiment=qwen3_8b", *given, *small, "eval.datasets=[humaneval]",
               "eval.n_prompts=1", "eval.max_new_tokens=8", "eval.budgets=[4]", "eval.compile=false",
               f"eval.out_dir={tmp_path / 'eval'}", "eval.prompt_tokens=32")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"ar", "chain", "ddtree", "weaver", "oracle"}
    assert all(r["greedy_match"] for r in rows)


def test_a_second_run_of_a_stage_waits_for_the_first_then_reuses_its_artifact(smoke, tmp_path):
    """Two runs on the same outputs never build one artifact together (they would share its work folder and
    the second would replace the first's artifact): the second waits on the artifact's lock, then finds it built."""
    from weaver.io import exclusive
    from weaver.pipeline import lock_file

    corpus = Path(json.loads((smoke / "smoke" / "artifacts.json").read_text())["corpus"])
    built = tmp_path / "artifacts" / corpus.name
    env = {**os.environ, "WEAVER_OUTPUTS": str(tmp_path), "WANDB_MODE": "disabled"}
    with exclusive(lock_file(built)):  # this test is the first run, mid-build
        second = subprocess.Popen([sys.executable, "train.py", "+experiment=smoke", "stages=[corpus]"], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = []
        for line in second.stdout:  # ends at its exit if it never waits
            said.append(line)
            if "[corpus] waiting for process" in line:
                break
        assert said and f"waiting for process {os.getpid()}" in said[-1], "".join(said)[-3000:]
        shutil.copytree(corpus, built)  # the first run's artifact appears, then its lock is released
    rest, _ = second.communicate(timeout=300)
    assert second.returncode == 0, rest[-3000:]
    assert "[corpus] up to date" in rest and "[corpus] building" not in "".join(said) + rest
