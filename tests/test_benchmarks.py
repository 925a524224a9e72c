"""Benchmark scripts run at a toy size, so they cannot rot (their speed figures come from full runs)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import run_script
from test_pipeline import ROOT
from weaver.eval.run import interleaved_round
from weaver.pipeline import ROOT_CONF


def test_gdn_tree_verify_benchmark_runs():
    args = ["--sizes", "4", "9", "--heads", "2", "--value-heads", "4", "--dim", "8", "--repeats", "1", "--threads", "1"]
    done = subprocess.run([sys.executable, "benchmarks/gdn_tree_verify.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 4 ") or line.startswith("| 9 ")]
    assert len(rows) == 2


def test_speculative_decoding_benchmark_runs(smoke_outputs):
    done = run_script("benchmarks/spec_decode.py", smoke_outputs, "+experiment=smoke", "--runs", "chain:3", "chain:auto",
                      "chain:auto:stepwise=1", "weaver:4", "weaver:4:rescore=2", "--repeats", "2", "eval.datasets=[heldout_code]",
                      "eval.n_prompts=1", "eval.max_new_tokens=8", "eval.compile=false")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" (")[0] for row in rows] == ["run", "ar", "chain:3", "chain:auto", "chain:auto:stepwise=1", "weaver:4",
                                                    "weaver:4:rescore=2"]
    # a run's eval.auto_budget setting reaches its planner: each probed its own costs
    assert "budget auto, chain (stepwise): ms per step" in done.stdout and "budget auto, chain: ms per step" in done.stdout
    weaver = next(line for line in done.stdout.splitlines() if line.startswith("| weaver:4 |"))
    assert re.search(r"\| [\d.]+x \([\d.]+-[\d.]+\) \|", weaver)  # two rounds: the per-round ratios' range


def test_sampling_rules_benchmark_runs(smoke_outputs, tmp_path):
    """Every rule settles the same recorded steps: as many steps per rule, the first rule's ratio to itself 1."""
    out = tmp_path / "rules.json"
    done = run_script("benchmarks/sampling_rules.py", smoke_outputs, "+experiment=smoke", "eval.temperature=1",
                      "--runs", "ddtree:4", "weaver:4", "--rules", "rrs", "traversal", "target_only", "--coins", "2",
                      "--out", str(out), "eval.datasets=[heldout_code]", "eval.n_prompts=1", "eval.max_new_tokens=8",
                      "eval.compile=false")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["run"], r["rule"]) for r in rows] == [(run, rule) for run in ("ddtree:4", "weaver:4")
                                                     for rule in ("rrs", "traversal", "target_only")]
    for run in ("ddtree:4", "weaver:4"):
        mine = [r for r in rows if r["run"] == run]
        assert len({r["steps"] for r in mine}) == 1 and mine[0]["vs_first"] == pytest.approx(1.0)
        assert all(0 <= r["accepted"] <= 4 and r["tau"] == pytest.approx(1 + r["accepted"]) for r in mine)
    greedy = run_script("benchmarks/sampling_rules.py", smoke_outputs, "+experiment=smoke", "--runs", "ddtree:4")
    assert greedy.returncode != 0 and "set eval.temperature > 0" in greedy.stderr


def spec_decode_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run: the benchmarks import their shared helpers
    spec = importlib.util.spec_from_file_location("spec_decode", ROOT / "benchmarks" / "spec_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_benchmark_run_may_set_its_acceptance_rule(monkeypatch):
    """ddtree:4 against ddtree:4:sampling=traversal in one process: the rule reaches eval.sampling, other settings
    stay where they were, and an unknown rule is refused before anything loads."""
    bench = spec_decode_module(monkeypatch)
    assert bench.parse_run("ddtree:4:sampling=traversal") == ("ddtree", 4, {"sampling": "traversal"})
    method, budget, settings = bench.parse_run("weaver:8:rescore=2,sampling=rrs")
    assert (method, budget, settings) == ("weaver", 8, {"rescore": 2, "sampling": "rrs"})
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=["+experiment=smoke"])
    cfg_run = bench.with_settings(cfg, settings)
    assert cfg_run.eval.sampling == "rrs" and cfg_run.weaver.search.rescore == 2
    assert bench.with_settings(cfg, {"sampling": "traversal"}).eval.sampling == "traversal"
    assert bench.with_settings(cfg, {}) is cfg
    with pytest.raises(SystemExit, match="sampling=<rrs"):
        bench.parse_run("ddtree:4:sampling=nope")


def test_interleaved_round_rotates_the_runs_from_prompt_to_prompt():
    calls = []

    def decoder(label):
        return lambda prompt: (calls.append((label, prompt[0])), ([prompt[0], label], f"{label}{prompt[0]}"))[1]

    done = interleaved_round({label: decoder(label) for label in "abc"}, [[0], [1], [2], [3]], shift=1)
    assert calls == [("b", 0), ("c", 0), ("a", 0), ("c", 1), ("a", 1), ("b", 1),
                     ("a", 2), ("b", 2), ("c", 2), ("b", 3), ("c", 3), ("a", 3)]
    for label, (outputs, stats, seconds) in done.items():  # each run's prompts in prompt order, its own time only
        assert outputs == [[i, label] for i in range(4)] and stats == [f"{label}{i}" for i in range(4)] and seconds > 0
    assert interleaved_round({}, [[0]]) == {}  # every run already measured (a resumed eval)


def test_budget_replay_compares_auto_with_every_fixed_budget(smoke_outputs, tmp_path):
    done = run_script("benchmarks/budget_replay.py", smoke_outputs, "+experiment=smoke", "--method", "ddtree",
                      "--explore-every", "2", "4", "--threads", "1", "--orders", "3", "--paths", str(tmp_path / "paths.json"),
                      "eval.datasets=[heldout_code]", "eval.n_prompts=2", "eval.max_new_tokens=12", "eval.compile=false")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    labels = [row[0].strip() for row in rows]
    settings = ["explore_every 2, decay 0.98, reach 1.75", "explore_every 4, decay 0.98, reach 1.75"]
    assert labels[:10] == ["budget", "1", "2", "4", *[label for every in settings for label in (
        f"auto ({every})", f"auto knowing the mean accepted drafts ({every}): exploration's cost")],
        "stepwise: each step's budget from its tree's path probabilities", "each prompt at its own best fixed budget"]
    fixed = [float(row[2]) for row in rows[1:4]]
    assert max(fixed) == 1.0  # the best fixed budget is the reference
    assert float(rows[9][2]) >= 1.0  # each prompt at its best budget is at least the best single budget
    assert sum(int(n) for n in re.findall(r": (\d+)", rows[8][3])) == sum(int(n) for n in re.findall(r": (\d+)", rows[4][3]))
    for row in (rows[4], rows[6]):  # the eval order's ratio lies within the spread over 3 orders
        median, low, high = map(float, re.fullmatch(r"(\S+) \((\S+)-(\S+)\)", row[4].strip()).groups())
        assert low <= float(row[2]) <= high and low <= median <= high
    assert labels[10:] == ["prompt", "heldout_code", "heldout_code"]  # the planner's estimates after each prompt
    recorded = json.loads((tmp_path / "paths.json").read_text())
    assert len(recorded["steps"]) == 2 and set(recorded["costs"]) == {"1", "2", "4"}
    for (_, paths), expected in zip(recorded["steps"], recorded["expected"]):  # each step's expected drafts, node by node
        assert len(expected) == len(paths) and all(0 <= e[0] and sorted(e) == e for e in expected)
    again = run_script("benchmarks/budget_replay.py", smoke_outputs, "+experiment=smoke", "--method", "ddtree", "--explore-every", "2",
                       "4", "--threads", "1", "--orders", "3", "--paths", str(tmp_path / "paths.json"), "eval.datasets=[heldout_code]")
    assert again.returncode == 0 and again.stdout.splitlines()[-12:] == done.stdout.splitlines()[-12:]  # replayed from the file
    subsets = run_script("benchmarks/budget_replay.py", smoke_outputs, "+experiment=smoke", "eval.datasets=[heldout_code]", "--method",
                         "ddtree", "--paths", str(tmp_path / "paths.json"), "--candidates", "4,1", "2")
    assert subsets.returncode == 0, subsets.stderr[-2000:]
    ratios = {row.split("|")[1].strip(): float(row.split("|")[3]) for row in subsets.stdout.splitlines()
              if row.startswith("| ") and "---" not in row and "budget" not in row and "prompt" not in row and "heldout" not in row}
    assert {"auto (explore_every 8, decay 0.98, reach 1.75, among [1, 4])", "auto (explore_every 8, decay 0.98, reach 1.75, among [2])"} <= set(ratios)
    assert max(ratios[b] for b in ("1", "2", "4")) == 1.0  # still against the whole recording's best fixed budget
    assert ratios["auto (explore_every 8, decay 0.98, reach 1.75, among [2])"] == ratios["2"]  # one candidate: that budget
    unrecorded = run_script("benchmarks/budget_replay.py", smoke_outputs, "+experiment=smoke", "--method", "ddtree", "--paths",
                            str(tmp_path / "paths.json"), "--candidates", "1,8")
    assert unrecorded.returncode != 0 and "--candidates [8] were not recorded (recorded: [1, 2, 4])" in unrecorded.stderr
    other = run_script("benchmarks/budget_replay.py", smoke_outputs, "+experiment=smoke", "--method", "weaver", "--paths",
                       str(tmp_path / "paths.json"))
    assert other.returncode != 0 and "records ddtree on smoke, not weaver on smoke" in other.stderr
    (tmp_path / "paths.json").write_text('{"costs": ')  # cut short
    corrupt = run_script("benchmarks/budget_replay.py", smoke_outputs, "+experiment=smoke", "--paths", str(tmp_path / "paths.json"))
    assert corrupt.returncode != 0 and "is not a recording of this script" in corrupt.stderr
    assert "Traceback" not in corrupt.stderr


def test_best_budget_sweep_writes_rows(smoke_outputs, tmp_path):
    out = tmp_path / "speed.json"
    done = run_script("benchmarks/spec_decode.py", smoke_outputs, "+experiment=smoke", "--best", "--methods", "ddtree",
                      "--repeats", "1", "--out", str(out), "eval.datasets=[heldout_code]", "eval.n_prompts=1",
                      "eval.max_new_tokens=8", "eval.compile=false")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["run"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ar", "ddtree:2", "ddtree:4", "ddtree:auto"}  # the smoke budgets [2, 4, auto]
    assert sum(r["best"] for r in rows.values() if r["method"] == "ddtree") == 1
    auto = rows["ddtree:auto"]
    assert auto["vs_ar_rounds"] == [pytest.approx(auto["vs_ar"])]  # one round
    assert auto["efficiency"] == pytest.approx(auto["vs_ar"] / auto["tau"]) and 1 <= auto["mean_budget"] <= 4
    steps = {int(b): n for b, n in auto["budget_steps"].items()}  # one round: its mix gives its mean budget
    assert sum(b * n for b, n in steps.items()) / sum(steps.values()) == pytest.approx(auto["mean_budget"])
    assert "(mean budget" in done.stdout and "; steps at " in done.stdout
    assert sum(auto[f"{p}_share"] for p in ("prefill", "draft", "search", "verify", "accept", "commit", "other")) == pytest.approx(1)


def test_verify_cost_benchmark_runs(smoke_outputs):
    done = run_script("benchmarks/verify_cost.py", smoke_outputs, "+experiment=smoke", "--sizes", "2", "5",
                      "--context", "16", "--repeats", "1", "eval.compile=false", "--prefill", "12")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["forward", "decode (eager)", "decode (compiled)", "verify 2", "verify 5", "prefill 12",
                    "prefill 12 (exact)"]
    done = run_script("benchmarks/verify_cost.py", smoke_outputs, "+experiment=smoke", "--sizes", "2", "--context", "16",
                      "--repeats", "1", "eval.compile=false", "--both-linears")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| verify 2 [prepacked] |" in done.stdout and "| verify 2 [F.linear] |" in done.stdout
    done = run_script("benchmarks/verify_cost.py", smoke_outputs, "+experiment=smoke", "--sizes", "2", "--context", "16",
                      "--repeats", "1", "eval.compile=false", "model.dtype=bfloat16", "--invariant-rows", "8", "16")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| verify 2 [8 rows] |" in done.stdout and "| decode (eager) [16 rows] |" in done.stdout


def test_train_precision_benchmark_runs():
    done = subprocess.run([sys.executable, "benchmarks/train_precision.py", "--settings", "fp32", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| fp32 | " in done.stdout and "cpu capability" in done.stdout


def test_inference_dtype_benchmark_runs(smoke_outputs):
    done = run_script("benchmarks/inference_dtype.py", smoke_outputs, "+experiment=smoke", "--new-tokens", "4",
                      "--repeats", "1", "--batch", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "batch 3, 64 prompt + 4 new tokens" in done.stdout
    names = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert names == ["fp32", "bf16", "bf16, fast kernels"]


def test_inference_dtype_agreement_table(smoke_outputs):
    done = run_script("benchmarks/inference_dtype.py", smoke_outputs, "+experiment=smoke", "--new-tokens", "6",
                      "--repeats", "1", "--agreement", "3", "eval.datasets=[heldout_code]", "eval.n_prompts=2")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:4] for line in done.stdout.splitlines() if line.startswith("| ") and " of " in line]
    assert [(name.strip(), total.split(" of ")[1].strip()) for name, total, _ in rows] == [
        ("fp32", "12"), ("bf16", "12"), ("bf16, fast kernels", "12")]


def test_argmax_flips_rereads_the_greedy_answer_position_by_position(target, monkeypatch):
    """Re-read one token per forward, the answer is what decoding computed: no position differs (an off-by-one
    in the re-reading would count every change of token along the answer). Read 4 at a time in fp32, the
    argmax holds too."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setitem(sys.modules, "fla", sys.modules.get("fla"))  # the script hides fla; undone after the test
    from inference_dtype import argmax_flips

    from weaver.generate import generate

    prompt = torch.randint(3, target.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    answer = generate(target, [prompt], 10)[0]
    assert sum(a != b for a, b in zip(answer, answer[1:])) >= 3  # the check below can see a shift
    assert argmax_flips(target, prompt, 10, 1) == (0, 10)
    assert argmax_flips(target, prompt, 10, 4) == (0, 10)


def test_draft_vocab_benchmark_runs(smoke_outputs):
    done = run_script("benchmarks/draft_vocab.py", smoke_outputs, "+experiment=smoke", "--sizes", "64", "256",
                      "--depths", "2", "--context", "8", "--repeats", "1", "eval.compile=false",
                      "drafter.draft_vocab_corpus=[]")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:3] for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    labels = [(a.strip(), b.strip()) for a, b in rows]
    assert labels[1:3] == [("random sixth", "responses only"), ("last sixth", "responses only")]
    coverage = [float(x) for line in done.stdout.splitlines() if line.startswith("| random sixth") for x in line.split("|")[3:5]]
    assert 0 < coverage[0] <= coverage[1] <= 1  # a larger vocabulary covers at least as much
    assert labels[4:] == [("whole", "eager"), ("n=64", "eager"), ("n=256", "eager")]


def test_adapter_pool_benchmark_runs(smoke_outputs):
    done = run_script("benchmarks/adapter_pool.py", smoke_outputs, "+experiment=smoke", "--pools", "4", "16", "64",
                      "--heldout", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(3 of them trained on)" in done.stdout  # the smoke adapter holds no rollouts out
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows] == ["pool", "4", "16", "64"]
    pool_mass = [float(r[1]) for r in rows[1:]]  # the same anchors at every pool: a wider pool holds more of the target
    assert pool_mass[0] < pool_mass[1] <= pool_mass[2] <= 1


def test_tree_calibration_benchmark_bins_every_reached_node(smoke_outputs, tmp_path):
    out = tmp_path / "calibration.json"
    done = run_script("benchmarks/tree_calibration.py", smoke_outputs, "+experiment=smoke", "--runs", "ddtree:4",
                      "weaver:4:rescore=2", "--out", str(out), "eval.datasets=[heldout_code]", "eval.n_prompts=1",
                      "eval.max_new_tokens=8", "eval.compile=false")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert set(results) == {"ddtree:4", "weaver:4:rescore=2"}
    for run in results.values():
        assert run["tau"] >= 1 and run["bins"] and all(0 <= b["accepted"] <= 1 for b in run["bins"])
        assert all(b["bin"][0] <= b["predicted"] <= b["bin"][1] for b in run["bins"])
