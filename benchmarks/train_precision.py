"""Training time with `precision: auto` (the default) against fp32 and bf16 forced, stage by stage.

    python benchmarks/train_precision.py --experiment smoke --repeats 3
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/train_precision.py   # as on an AVX2-only CPU

Each round runs `train.py +experiment=NAME` from an empty outputs folder once per setting (interleaved),
and the per-stage build times it prints are compared as medians. The second line of the environment
variables above makes torch and oneDNN use only AVX2 kernels, which is how we time an older CPU here.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "auto": [],
    "fp32": ["model.train.precision=fp32", "drafter.train.precision=fp32", "weaver.train.precision=fp32"],
    "bf16": ["model.train.precision=bf16", "drafter.train.precision=bf16", "weaver.train.precision=bf16"],
}


def stage_seconds(experiment: str, overrides: list[str]) -> tuple[dict[str, float], str]:
    """Build every stage of `experiment` in a fresh outputs folder; ({stage: seconds}, precision line)."""
    with tempfile.TemporaryDirectory() as outputs:
        env = {**os.environ, "WEAVER_OUTPUTS": outputs, "WANDB_MODE": "disabled"}
        done = subprocess.run([sys.executable, "train.py", f"+experiment={experiment}", *overrides],
                              cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train.py failed:\n{done.stderr[-2000:]}")
    times = {m[1]: float(m[2]) for m in re.finditer(r"\[(\w+)\] built in ([\d.]+) s", done.stdout)}
    chosen = next((line for line in done.stdout.splitlines() if line.startswith("precision:")), "precision: explicit")
    return times, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="smoke")
    parser.add_argument("--settings", nargs="+", default=["auto", "fp32", "bf16"], choices=list(SETTINGS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.settings}
    for _ in range(args.repeats):
        for name in args.settings:
            times, chosen = stage_seconds(args.experiment, SETTINGS[name])
            runs[name].append(times)
            if name == "auto":
                print(chosen)
    stages = list(runs[args.settings[0]][0])
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, +experiment={args.experiment}, "
          f"median of {args.repeats} interleaved runs (seconds per stage)")
    print("| precision | " + " | ".join(stages) + " | total |")
    print("|---" * (len(stages) + 2) + "|")
    for name, rounds in runs.items():
        medians = [statistics.median(r[s] for r in rounds) for s in stages]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in medians) + f" | {sum(medians):.1f} |")


if __name__ == "__main__":
    main()
