"""`eval.py eval.backend=sglang`: the eval's prompt sets and result rows, decoded by SGLang's engine.

Each (method, budget) is one engine (`weaver.serving.sglang.runs`, started with SGLang's interpreter,
`eval.sglang.python`): `ar` is SGLang's plain decoding, `chain` SGLang's own DFLASH on the same drafter,
`ddtree` and `weaver` our tree workers (`--speculative-algorithm DDTREE / WEAVER`). Every prompt set is
sent in batches of each `eval.sglang.concurrency` (the requests of a batch in flight together); a row per
(dataset, method, budget, concurrency) with `backend: sglang`. τ = (verify steps + drafts accepted) /
verify steps, from SGLang's per-request counters (the reference engine's definition); tokens/s = output
tokens / wall time of the batches; speedups against SGLang's plain decoding and DFLASH at the same
concurrency; `greedy_match` = the same tokens as SGLang's plain greedy decoding. Each finished engine run
is kept in the eval's `.partial` folder, so a killed eval resumes (results.PartialRun).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import DictConfig
from tqdm.auto import tqdm

from weaver.acceptance import DRAWN_TREE_RULES
from weaver.artifacts import adapter_folder, drafter_folder, target_folder
from weaver.builders import TREE_METHODS
from weaver.data.prompts import encode_prompts, template_kwargs
from weaver.errors import WeaverError
from weaver.eval.results import PartialRun, append_rows, result_row
from weaver.eval.transformers_reference import load_transformers_target, transformers_greedy
from weaver.models.checkpoint import load_hf_config, load_tokenizer
from weaver.models.config import is_count
from weaver.models.drafter_checkpoint import drafter_config
from weaver.precision import inference_dtype, resolve_device
from weaver.serving.sglang import ALGORITHMS as WORKERS
from weaver.serving.sglang import DRAFT_TEMPERATURE_ENV, FIXED_CHILDREN_ENV, RRS_PRIORITY_ENV, SAMPLING_ENV
from weaver.serving.sglang.runs import CPU_ENGINE, stand_ins_environment

ALGORITHMS = {"ar": None, "chain": "DFLASH", "ddtree": "DDTREE", "weaver": "WEAVER"}  # eval method -> SGLang's
VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"  # scripts/install.sh --serve
Run = tuple[str, "int | None"]  # (method, budget)


def sglang_python(cfg: DictConfig) -> str:
    """The interpreter with SGLang: eval.sglang.python, else .venv-sglang, else this one if it has SGLang."""
    given = cfg.eval.sglang.python
    if given is not None:
        if not Path(given).is_file():
            raise WeaverError(f"eval.sglang.python: no interpreter at {given}")
        return str(given)
    if VENV_PYTHON.is_file():
        return str(VENV_PYTHON)
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    raise WeaverError("eval.backend=sglang needs SGLang: `bash scripts/install.sh --serve` builds .venv-sglang "
                      "(or point eval.sglang.python at an interpreter that has it)")


def uses_adapter(method: str) -> bool:
    return method in TREE_METHODS and "adapter" in TREE_METHODS[method].needs


def check_sglang_eval(cfg: DictConfig) -> None:
    """Refuse what the SGLang backend cannot measure, before anything starts."""
    e = cfg.eval
    unsupported = [m for m in e.methods if m not in ALGORITHMS]
    if unsupported:
        raise WeaverError(f"eval.backend=sglang measures {list(ALGORITHMS)}, not {unsupported}")
    if any(not is_count(b) for b in e.budgets):
        raise WeaverError(f"eval.backend=sglang needs fixed budgets (whole numbers >= 1), got {list(e.budgets)}")
    if e.temperature > 0 and e.sampling not in DRAWN_TREE_RULES:
        raise WeaverError(f"eval.backend=sglang draws sampled requests' trees: eval.sampling must be one of "
                          f"{DRAWN_TREE_RULES}, got {e.sampling!r}")
    if not e.sglang.concurrency or any(not is_count(c) for c in e.sglang.concurrency):
        raise WeaverError(f"eval.sglang.concurrency must list whole numbers >= 1, got {e.sglang.concurrency}")


def engine_runs(cfg: DictConfig, drafter: Path | None) -> list[Run]:
    """AR first (the baseline), then every method at its budgets (the chain: its drafter's whole block)."""
    runs: list[Run] = []
    for method in sorted(cfg.eval.methods, key=lambda m: m != "ar"):
        if method == "ar":
            runs.append(("ar", None))
        elif TREE_METHODS[method].whole_block:
            runs.append((method, drafter_config(load_hf_config(drafter)).block_size - 1))
        else:
            runs += [(method, int(b)) for b in cfg.eval.budgets]
    return runs


def batches(prompt_sets: dict[str, list[list[int]]], concurrency: list[int]) -> list[tuple[str, int, list[list[int]]]]:
    """(dataset, concurrency, requests) for every prompt set cut into batches of each concurrency."""
    return [(name, c, prompts[i : i + c]) for c in concurrency for name, prompts in prompt_sets.items()
            for i in range(0, len(prompts), c)]


def engine_spec(cfg: DictConfig, run: Run, target: Path, drafter: Path | None, adapter: Path | None,
                requests: list[list[list[int]]], eos: int | None) -> dict:
    """What `weaver.serving.sglang.runs` needs for one engine over every batch."""
    method, budget = run
    e, engine = cfg.eval, dict(cfg.eval.sglang.engine or {})
    if e.sglang.cpu_stand_ins:
        engine = {**CPU_ENGINE, **engine}
    elif cfg.model.dtype != "auto":
        engine.setdefault("dtype", cfg.model.dtype)
    env = {}
    if method in WORKERS.values() and e.temperature > 0:  # our workers' rule and trees for sampled requests
        env = {SAMPLING_ENV: e.sampling, RRS_PRIORITY_ENV: e.rrs_priority, FIXED_CHILDREN_ENV: str(e.fixed_children)}
        if e.draft_temperature is not None:
            env[DRAFT_TEMPERATURE_ENV] = str(e.draft_temperature)
    if uses_adapter(method):
        env |= {"WEAVER_ADAPTER": str(adapter), "WEAVER_CHILDREN": str(cfg.weaver.search.children)}
        if cfg.weaver.search.nodes_per_call is not None:
            env["WEAVER_NODES_PER_CALL"] = str(cfg.weaver.search.nodes_per_call)
        if cfg.weaver.search.pool is not None:
            env["WEAVER_POOL"] = str(cfg.weaver.search.pool)
        if cfg.weaver.search.rescore is not None:
            env["WEAVER_RESCORE"] = str(cfg.weaver.search.rescore)
    return {
        "target": str(target), "algorithm": ALGORITHMS[method], "drafter": str(drafter) if drafter else None,
        "num_draft_tokens": None if budget is None else budget + 1, "env": env, "engine": engine,
        "batches": requests, "max_new_tokens": e.max_new_tokens, "temperature": e.temperature, "seed": e.seed,
        "eos": eos,
    }


def run_in_sglang(cfg: DictConfig, spec: dict, label: str, log: Path) -> list[dict]:
    """Run one engine spec in SGLang's interpreter, its output kept in `log`; one line naming SGLang's error
    (or ours, from the worker) if it fails."""
    env = dict(os.environ)
    if cfg.eval.sglang.cpu_stand_ins:
        env.update(stand_ins_environment(cfg.eval.sglang.cpu_stand_ins))
    with tempfile.TemporaryDirectory() as work:
        spec_path, out_path = Path(work) / "spec.json", Path(work) / "out.json"
        spec_path.write_text(json.dumps(spec))
        command = [sglang_python(cfg), "-m", "weaver.serving.sglang.runs", str(spec_path), str(out_path)]
        with open(log, "w") as output:
            done = subprocess.run(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                  timeout=cfg.eval.sglang.timeout_s)
        if done.returncode != 0:
            raise WeaverError(f"SGLang run {label} failed: {_last_error(log.read_text())} (its output: {log})")
        return json.loads(out_path.read_text())


def _last_error(output: str) -> str:
    """The last line that names an exception (SGLang prints a traceback per process)."""
    lines = [line.strip() for line in output.splitlines() if "Error" in line or "Exception" in line]
    return lines[-1] if lines else "no error line"


def measure(runs: list[dict], plan: list[tuple[str, int, list[list[int]]]], dataset: str, concurrency: int) -> dict:
    """One (dataset, concurrency) slice of an engine's batches: outputs, τ, tokens/s."""
    mine = [r for r, (name, c, _) in zip(runs, plan) if (name, c) == (dataset, concurrency)]
    outputs = [ids for r in mine for ids in r["ids"]]
    steps, drafts = sum(s for r in mine for s in r["steps"]), sum(d for r in mine for d in r["drafts"])
    n_tokens = sum(map(len, outputs))
    return {"outputs": outputs, "n_tokens": n_tokens, "tokens_per_s": n_tokens / sum(r["seconds"] for r in mine),
            "tau": (steps + drafts) / steps if steps else 1.0, "verify_steps": steps}


def evaluate_with_sglang(cfg: DictConfig, prompt_sets: dict[str, list[list[int]]], eos: int | None,
                         folders: dict[str, Path | None], partial: PartialRun) -> dict[tuple, dict]:
    """{(dataset, concurrency, method, budget): measurement} for every engine run of the config."""
    runs = engine_runs(cfg, folders["drafter"])
    plan = batches(prompt_sets, list(cfg.eval.sglang.concurrency))
    requests = [batch for _, _, batch in plan]
    measured = {}
    for method, budget in tqdm(runs, desc="eval (sglang)"):
        label = f"{method}" + (f"@{budget}" if budget is not None else "")
        spec = engine_spec(cfg, (method, budget), folders["target"], folders["drafter"], folders["adapter"], requests, eos)
        done = partial.get("sglang", method, budget) or partial.put("sglang", method, budget, {
            "batches": run_in_sglang(cfg, spec, label, partial.folder / f"sglang--{method}--{budget}.log")})
        for dataset in prompt_sets:
            for c in cfg.eval.sglang.concurrency:
                measured[dataset, c, method, budget] = measure(done["batches"], plan, dataset, c)
    return measured


def measure_in_sglang(cfg: DictConfig, prompt_sets: dict, results: Path, partial: PartialRun) -> list[dict]:
    """The rows of every dataset x method x budget x concurrency, measured through SGLang; appended to `results`."""
    check_sglang_eval(cfg)
    e, methods = cfg.eval, set(cfg.eval.methods)
    folders = {"target": target_folder(cfg), "drafter": drafter_folder(cfg) if methods - {"ar"} else None,
               "adapter": adapter_folder(cfg) if any(map(uses_adapter, methods)) else None}
    tokenizer = load_tokenizer(folders["target"])
    encoded = {name: encode_prompts(rows, tokenizer, e.n_prompts, e.prompt_tokens, e.long_prompts, template_kwargs(cfg))
               for name, rows in prompt_sets.items()}
    measured = evaluate_with_sglang(cfg, encoded, tokenizer.eos_token_id, folders, partial)
    references = transformers_references(cfg, encoded, tokenizer.eos_token_id, partial)
    baselines = {(d, c, method): r for (d, c, method, _), r in measured.items() if method in ("ar", "chain")}
    rows = []
    for (dataset, concurrency, method, budget), r in measured.items():
        ar, chain = (baselines.get((dataset, concurrency, kind)) for kind in ("ar", "chain"))
        baseline = {"tokens_per_s": ar["tokens_per_s"], "reference": ar["outputs"]} if ar else None
        rows.append({**result_row(cfg, dataset, method, budget, r, baseline, len(encoded[dataset]), references.get(dataset),
                                  backend="sglang", concurrency=concurrency),
                     "speedup_vs_dflash": r["tokens_per_s"] / chain["tokens_per_s"] if chain else None,
                     "verify_steps": r["verify_steps"], "run_id": partial.run_id})
    append_rows(results, rows)
    return rows


def transformers_references(cfg: DictConfig, encoded: dict[str, list[list[int]]], eos: int | None,
                            partial: PartialRun) -> dict[str, list[list[int]]]:
    """With eval.check_transformers (greedy): transformers' own greedy outputs per dataset, here in weaver's
    environment on the same checkpoint, which every SGLang row is compared with."""
    if not (cfg.eval.check_transformers and cfg.eval.temperature == 0):
        return {}
    device = resolve_device(cfg.device)
    model = load_transformers_target(cfg, inference_dtype(cfg.model.dtype, device), device)
    return {name: (partial.get(name, "transformers", None) or partial.put(name, "transformers", None, {
        "outputs": transformers_greedy(model, prompts, cfg.eval.max_new_tokens, eos)}))["outputs"]
        for name, prompts in encoded.items()}
