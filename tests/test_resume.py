"""Kill anywhere, rerun the same command, same result (issue #18).

Each test runs train.py / eval.py as a real process and SIGKILLs it (no cleanup handler runs) at a point
inside a stage — a folder written but not yet published, right after a checkpoint or a shard — by
tests/kill_at.py, which kills the process from inside at that exact call (so the point is hit on a fast
machine too), or after a random delay. It reruns the same command and compares what comes out with an
uninterrupted run: weights equal to 1e-6, rollouts and stored states row for row, eval rows once each.
The reruns must also say that they resumed, so a "resume" that quietly starts over fails too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT

SMOKE = ("+experiment=smoke",)
WEIGHT_TOLERANCE = 1e-6  # same machine, same kernels: resumed training is bitwise equal in practice


def _env(outputs: Path) -> dict[str, str]:
    return {**os.environ, "WEAVER_OUTPUTS": str(outputs), "WANDB_MODE": "disabled"}


def kill_when(script: str, outputs: Path, overrides: tuple[str, ...], ready: Callable[[], bool],
              may_finish: bool = False, timeout: float = 600) -> str | None:
    """Start `script`, SIGKILL its whole process group as soon as `ready()` holds; returns its output so far.
    A process that ends before the kill point fails the test, unless `may_finish` (then: None)."""
    log = outputs / f"killed-{time.monotonic_ns()}.log"
    outputs.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, script, *overrides], cwd=ROOT, env=_env(outputs), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                assert may_finish and proc.returncode == 0, f"{script} ended first:\n{log.read_text()[-3000:]}"
                return None
            assert time.monotonic() < deadline, f"kill point not reached in {timeout} s"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return log.read_text()


def kill_at(point: tuple[str, str, str], script: str, outputs: Path, overrides: tuple[str, ...]) -> str:
    """Run `script` until `point` = (before|after, module.function, argument pattern), where it is SIGKILLed
    (tests/kill_at.py); returns its output. Fails unless it died of that kill."""
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "kill_at.py"), *point, script, *overrides], cwd=ROOT,
                          env=_env(outputs), capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, f"not killed at {point}:\n{done.stderr[-3000:]}"
    return done.stdout


def run_to_end(script: str, outputs: Path, overrides: tuple[str, ...]) -> str:
    done = subprocess.run([sys.executable, script, *overrides], cwd=ROOT, env=_env(outputs), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def assert_same_weights(a: Path, b: Path) -> None:
    """Every safetensors tensor of artifact folder `a` equals `b`'s within WEIGHT_TOLERANCE."""
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for name in files:
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys()
        for key in x:
            torch.testing.assert_close(x[key], y[key], atol=WEIGHT_TOLERANCE, rtol=0, msg=f"{name}:{key}")


def assert_same_rows(a: Path, b: Path) -> None:
    """Two datasets on disk hold the same rows in the same order (and, for rollouts, each prompt once)."""
    x, y = datasets.load_from_disk(str(a)), datasets.load_from_disk(str(b))
    assert x.to_dict() == y.to_dict()


def test_train_killed_in_every_stage_resumes_to_the_same_artifacts(smoke_outputs, tmp_path):
    """Five kills of one smoke training run, one inside each stage; the final rerun's artifacts equal those
    of the uninterrupted run (tests/conftest.py::smoke_outputs)."""
    out = tmp_path / "outputs"
    checkpoint = "weaver.train.common.durable_rename"  # publishes a checkpoint (step-N.tmp -> step-N)
    kill_points = [
        ("before", "weaver.io.durable_rename", "*corpus-*"),  # the corpus folder written, not published
        ("after", checkpoint, "*target-*step-0000020"),  # right after a checkpoint
        ("before", checkpoint, "*target-*step-0000040"),  # a checkpoint written, not published
        ("after", "weaver.io.durable_rename", "*rollouts-*shard-00000"),  # right after a shard
        ("after", checkpoint, "*drafter-*step-0000015"),
        ("after", checkpoint, "*weaver-*step-0000010"),
    ]
    logs = [kill_at(point, "train.py", out, SMOKE) for point in kill_points]
    final = run_to_end("train.py", out, SMOKE)
    # each rerun resumed the stage its predecessor was killed in (a half-written checkpoint is not resumed from)
    assert "resuming target" in logs[2] and "(step 20)" in logs[2] and "(step 20)" in logs[3]
    assert "rollouts: resuming, 1 of 3 shards" in logs[4] and "resuming drafter" in logs[5] and "resuming weaver" in final
    assert not list((out / "artifacts").glob("*.tmp-*")) and not list((out / "artifacts").glob("*.work"))

    reference = json.loads((smoke_outputs / "smoke" / "artifacts.json").read_text())
    resumed = json.loads((out / "smoke" / "artifacts.json").read_text())
    assert [Path(p).name for p in resumed.values()] == [Path(p).name for p in reference.values()]
    for stage in ("target", "drafter", "weaver"):
        assert_same_weights(Path(resumed[stage]), Path(reference[stage]))
        steps = [json.loads((Path(run[stage]) / "train_summary.json").read_text())["step"] for run in (resumed, reference)]
        assert steps[0] == steps[1]
    assert_same_rows(Path(resumed["corpus"]) / "dataset" / "train", Path(reference["corpus"]) / "dataset" / "train")
    rollouts = Path(resumed["rollouts"]) / "dataset"
    assert_same_rows(rollouts, Path(reference["rollouts"]) / "dataset")
    assert datasets.load_from_disk(str(rollouts))["prompt_index"] == list(range(48))  # none missing, none twice


@pytest.mark.parametrize("kills", [pytest.param(2, id="smoke"), pytest.param(12, id="full", marks=pytest.mark.slow)])
def test_train_killed_at_random_moments_ends_as_an_uninterrupted_run(smoke_outputs, tmp_path, kills):
    """SIGKILL after seeded random delays (whatever the process is doing then), rerun each time; the
    artifacts equal the uninterrupted run's."""
    out, delays = tmp_path / "outputs", torch.Generator().manual_seed(kills)
    killed = 0
    for _ in range(kills):
        delay = 2 + 3 * torch.rand((), generator=delays).item()  # the imports alone take ~3 s, the run ~10 s
        start = time.monotonic()
        if kill_when("train.py", out, SMOKE, lambda: time.monotonic() - start > delay, may_finish=True) is None:
            break
        killed += 1
    assert killed >= 1
    run_to_end("train.py", out, SMOKE)
    reference = json.loads((smoke_outputs / "smoke" / "artifacts.json").read_text())
    resumed = json.loads((out / "smoke" / "artifacts.json").read_text())
    for stage in ("target", "drafter", "weaver"):
        assert_same_weights(Path(resumed[stage]), Path(reference[stage]))
    assert_same_rows(Path(resumed["rollouts"]) / "dataset", Path(reference["rollouts"]) / "dataset")


def test_weight_comparison_sees_a_small_change(smoke_outputs, tmp_path):
    """Negative control: the comparison above fails for a drafter one step of noise away."""
    drafter = Path(json.loads((smoke_outputs / "smoke" / "artifacts.json").read_text())["drafter"])
    changed = tmp_path / "drafter"
    changed.mkdir()
    from safetensors.torch import save_file

    for path in drafter.glob("*.safetensors"):
        tensors = load_file(path)
        first = next(iter(tensors))
        tensors[first] = tensors[first] + 1e-4
        save_file(tensors, changed / path.name)
    with pytest.raises(AssertionError):
        assert_same_weights(changed, drafter)


def test_states_killed_after_a_shard_resume_to_the_same_states(smoke_outputs, tmp_path):
    """The `states` stage killed after its first shard: the rerun keeps that shard and the result equals an
    uninterrupted build's, shard for shard."""
    import shutil

    overrides = (*SMOKE, "stages=[states]", "rollouts.store_states=true", "rollouts.shard_size=16")
    runs = {}
    for name in ("killed", "whole"):
        out = tmp_path / name
        shutil.copytree(smoke_outputs / "artifacts", out / "artifacts")
        if name == "killed":
            kill_at(("after", "weaver.data.states.durable_rename", "*shard-00000.safetensors"), "train.py", out, overrides)
        runs[name] = (run_to_end("train.py", out, overrides), next((out / "artifacts").glob("states-*[!k]")))
    assert "states: resuming, 1 of 3 shards" in runs["killed"][0]
    killed, whole = runs["killed"][1], runs["whole"][1]
    assert sorted(p.name for p in killed.iterdir()) == sorted(p.name for p in whole.iterdir())
    for shard in whole.glob("*.safetensors"):
        x, y = load_file(shard), load_file(killed / shard.name)
        assert all(torch.equal(x[k], y[k]) for k in x)


EVAL = (*SMOKE, "eval.datasets=[heldout_code,humaneval]", "eval.methods=[ar,chain,ddtree]", "eval.budgets=[2,4]")


def test_eval_killed_twice_resumes_without_redoing_or_duplicating_rows(smoke_outputs, tmp_path):
    """eval.py killed mid-dataset, then right after the first dataset's rows were appended: the reruns reuse
    every finished measurement (same numbers) and each (dataset, method, budget) row appears once."""
    results = tmp_path / "eval"
    overrides = (*EVAL, f"eval.out_dir={results}")
    kill_at(("after", "weaver.eval.results.atomic_write_json", "*heldout_code--ddtree--2.json*"), "eval.py",
            smoke_outputs, overrides)
    finished = {p.name: json.loads(p.read_text()) for p in results.glob(".partial/*/*--*.json")}
    assert {"heldout_code--ar--None.json", "heldout_code--chain--7.json", "heldout_code--ddtree--2.json"} <= set(finished)
    kill_at(("after", "weaver.eval.run.append_rows", "*results.jsonl*"), "eval.py", smoke_outputs, overrides)
    assert (results / "results.jsonl").exists()
    log = run_to_end("eval.py", smoke_outputs, overrides)
    assert "resuming a killed run" in log
    rows = [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines()]
    keys = [(r["dataset"], r["method"], r["budget"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * (1 + 1 + 2)  # ar, chain (whole block), ddtree at 2 and 4
    assert len({r["run_id"] for r in rows}) == 1 and all(r["greedy_match"] for r in rows)
    for r in rows:  # measured before the first kill: taken as they were, not measured again
        if (saved := finished.get(f"{r['dataset']}--{r['method']}--{r['budget']}.json")) is not None:
            assert (r["tau"], r["tokens_per_s"]) == (saved["tau"], saved["tokens_per_s"])
    assert not list(results.glob(".partial/*")), "a finished run removes its partial measurements"
