"""Multi-process training on CPU (gloo): `accelerate launch --multi_gpu --num_processes 2 train.py
+experiment=smoke device=cpu` (accelerate's own `--cpu` multi-process mode needs MPI; `--multi_gpu` is its
torchrun launcher, which works on CPUs too).

Training stages run on both processes with the data sharded; the data stages (rollouts, states) split their
shards between them and write the artifact one process writes; the corpus is built by rank 0 alone; every
artifact is written once, by rank 0."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, run_script

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def test_two_processes_train_the_smoke_pipeline_writing_each_artifact_once(tmp_path, smoke_outputs):
    env = {**os.environ, "WEAVER_OUTPUTS": str(tmp_path), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*LAUNCH, "train.py", "+experiment=smoke", "device=cpu", "rollouts.store_states=true"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads((tmp_path / "smoke" / "artifacts.json").read_text())
    assert set(built) == {"corpus", "target", "rollouts", "states", "drafter", "weaver"}
    log = done.stdout
    for stage in built:
        assert log.count(f"[{stage}] building") == 1  # printed by rank 0 only
    for stage in ("target", "drafter", "weaver"):  # trained by both processes, each on half of every epoch
        assert f"{stage}: 2 processes x batch 8" in log
    artifacts = sorted(p.name for p in (tmp_path / "artifacts").iterdir())
    assert artifacts == sorted(os.path.basename(p) for p in built.values())  # no temporary or work folders left
    summary = json.loads((tmp_path / "artifacts" / os.path.basename(built["weaver"]) / "train_summary.json").read_text())
    assert summary["step"] == 20
    # the same schedule as one process, on twice the batch: the target ends no worse than a one-process run
    one_target = json.loads((smoke_outputs / "smoke" / "artifacts.json").read_text())["target"]
    one = json.loads((Path(one_target) / "train_summary.json").read_text())
    two = json.loads((Path(built["target"]) / "train_summary.json").read_text())
    assert two["val_loss"] < one["val_loss"] + 0.2, (two["val_loss"], one["val_loss"])
    # the data stages: each process built its share of the shards (3 of 16 rollouts: rank 0 two, rank 1 one) ...
    for stage in ("rollouts", "states"):
        assert f"{stage}: process 1 of 2 builds shards 1, 3, ... (1 of its 1 missing)" in log
        assert f"{stage}: process 0 of 2 builds shards 0, 2, ... (2 of its 2 missing)" in log
    # ... and the artifacts are, file for file, what one process builds from the same target
    kept = {stage: shutil.move(built[stage], tmp_path / f"{stage}.two") for stage in ("rollouts", "states")}
    done = subprocess.run([sys.executable, "train.py", "+experiment=smoke", "device=cpu", "rollouts.store_states=true",
                           "stages=[rollouts,states]"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for stage, two_dir in kept.items():
        same_tree(Path(two_dir), Path(built[stage]))


def test_a_two_process_build_killed_mid_stage_resumes_in_one_process(tmp_path, smoke_outputs):
    """Six states shards; process 1 (shards 1, 3, 5) SIGKILLed right before publishing its last, so process 0 can never
    merge (the launcher then stops it); a one-process rerun keeps the shards written and ends with the states an
    uninterrupted one-process build writes."""
    overrides = ("+experiment=smoke", "device=cpu", "stages=[states]", "rollouts.store_states=true", "rollouts.shard_size=8")
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    for out in (killed, whole):
        shutil.copytree(smoke_outputs / "artifacts", out / "artifacts")
    env = {**os.environ, "WEAVER_OUTPUTS": str(killed), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    kill = ["tests/kill_at.py", "before", "weaver.data.states.durable_rename", "*shard-00005.safetensors", "train.py"]
    done = subprocess.run([*LAUNCH, *kill, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode != 0 and "SIGKILL" in done.stderr, done.stderr[-3000:]
    [work] = (killed / "artifacts").glob("states-*.work")
    written = sorted(p.name for p in (work / "shards").glob("shard-*.safetensors"))
    assert {"shard-00001.safetensors", "shard-00003.safetensors"} <= set(written), written
    assert "shard-00005.safetensors" not in written and not list((killed / "artifacts").glob("states-*[!k]"))
    resumed = run_script("train.py", killed, *overrides, OMP_NUM_THREADS="1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"states: resuming, {len(written)} of 6 shards already done" in resumed.stdout
    assert run_script("train.py", whole, *overrides, OMP_NUM_THREADS="1").returncode == 0
    [states], [reference] = ((out / "artifacts").glob("states-*[!k]") for out in (killed, whole))
    same_tree(states, reference)


def same_tree(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for name in files:
        if name.name == "state.json":  # HF datasets' fingerprint: random per save, not content
            continue
        assert filecmp.cmp(a / name, b / name, shallow=False), name
