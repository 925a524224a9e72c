"""One SGLang engine over batches of requests, timed: what `eval.py eval.backend=sglang` and
benchmarks/serve_sglang.py run in the SGLang environment (SGLang pins a torch of its own, so they start
this module there as a process):

    .venv-sglang/bin/python -m weaver.serving.sglang.runs SPEC.json OUT.json

SPEC: {"target": folder, "algorithm": null (plain decoding) | "WEAVER" | "DDTREE" | "DFLASH" | ...,
"drafter": folder, "num_draft_tokens": tree size with its root (null: the algorithm's default),
"env": variables for the worker (WEAVER_ADAPTER, ...), "engine": more `sglang.Engine` arguments,
"batches": [[prompt token ids, ...], ...], "max_new_tokens", "temperature", "seed", "eos"}. Each batch is sent as
one `generate` call (its requests in flight together), after the first batch once more outside the timing
(first calls pay for allocation and kernel set-up).
OUT: per batch, each request's output ids, verify steps and drafts accepted, and the batch's wall time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from weaver.io import atomic_write_json

# SGLang's CPU engine, with the test-side stand-ins for its CPU kernels (README, "Serving with SGLang")
CPU_ENGINE = dict(device="cpu", attention_backend="torch_native", dtype="float32", disable_cuda_graph=True,
                  mem_fraction_static=0.3, max_total_tokens=8192)


def stand_ins_environment(folder: str | Path) -> dict[str, str]:
    """The variables that put the stand-ins for sgl_kernel's CPU build (a folder) under SGLang's CPU engine:
    read when SGLang is imported, by this process and the scheduler processes it starts."""
    path = os.pathsep.join(filter(None, [str(Path(folder).resolve()), os.environ.get("PYTHONPATH")]))
    return {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path}


def engine_arguments(spec: dict) -> dict:
    """`sglang.Engine` keyword arguments: the target, the speculative algorithm's, and the spec's own."""
    args = dict(model_path=spec["target"], skip_tokenizer_init=True, log_level="error")
    if spec.get("algorithm"):
        args.update(speculative_algorithm=spec["algorithm"], speculative_draft_model_path=spec["drafter"])
        if spec.get("num_draft_tokens") is not None:
            args["speculative_num_draft_tokens"] = spec["num_draft_tokens"]
    return {**args, **spec.get("engine", {})}


@contextmanager
def environment(variables: dict[str, str]):
    """`variables` set while the engine starts (its scheduler processes read them), then restored."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def sampling_params(spec: dict, request: int) -> dict:
    """Greedy, or the spec's temperature with a seed per request (reproducible draws)."""
    params = {"max_new_tokens": spec["max_new_tokens"], "temperature": spec.get("temperature", 0.0)}
    if spec.get("eos") is not None:  # besides the checkpoint's own end tokens, which SGLang stops at anyway
        params["stop_token_ids"] = [spec["eos"]]
    if params["temperature"] > 0:
        params["sampling_seed"] = spec.get("seed", 0) + request
    return params


def run_engine(spec: dict) -> list[dict]:
    """Start the engine, warm it up on the first batch, send every batch; per batch {"ids", "steps", "drafts",
    "seconds"}."""
    import sglang as sgl

    with environment(spec.get("env", {})):
        engine = sgl.Engine(**engine_arguments(spec))
    try:
        engine.generate(input_ids=spec["batches"][0], sampling_params=[sampling_params(spec, 0)] * len(spec["batches"][0]))
        results, request = [], 0
        for batch in spec["batches"]:
            params = [sampling_params(spec, request + i) for i in range(len(batch))]
            request += len(batch)
            start = time.perf_counter()
            outputs = engine.generate(input_ids=batch, sampling_params=params)
            seconds = time.perf_counter() - start
            results.append({
                "ids": [o["output_ids"] for o in outputs], "seconds": seconds,
                "steps": [o["meta_info"].get("spec_verify_ct", 0) for o in outputs],
                "drafts": [o["meta_info"].get("spec_num_correct_drafts", 0) for o in outputs],
            })
        return results
    finally:
        engine.shutdown()


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python -m weaver.serving.sglang.runs SPEC.json OUT.json")
    spec = json.loads(Path(sys.argv[1]).read_text())
    atomic_write_json(Path(sys.argv[2]), run_engine(spec))


if __name__ == "__main__":  # SGLang starts its scheduler processes by spawning: nothing may run on import
    main()
