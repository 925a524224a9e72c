"""The target's verify cost against tree size: what a speculative step must pay back.

    python benchmarks/verify_cost.py +experiment=smollm2
    python benchmarks/verify_cost.py +experiment=tiny --sizes 2 5 9 17 33 --context 100

After a prefill of --context pseudo-random tokens, times `TargetModel.verify` on random trees of each size
(nothing is committed, so every call sees the same cache) and one-token decode steps, eager and compiled
(`eval.compile`: true or max-autotune; a compiled verify pads the tree to its size bucket, `verify_size`),
interleaved over --repeats rounds (in a fresh random order each round); medians. --both-linears times every forward
twice, with prepacked weights and with `F.linear` (`eval.prepack`, weaver/models/linear.py), interleaved;
--invariant-rows 8 16 16:32 times every forward once per setting of lossless bf16's fixed-size matmul calls: R rows a
call, or R:C for rows padded to R and calls of at most C (`INVARIANT_ROWS`, `CALL_ROWS`; with model.dtype=bfloat16 on
a CPU). --prefill N ... also times a prompt of N pseudo-random tokens read as decoders read it (`TargetModel.prefill`,
bf16's fast kernels) and read exactly (as a verify pass reads its nodes). Arguments other than the options are
eval.py overrides (model, dtype, device).

    python benchmarks/verify_cost.py +experiment=smollm2 model.dtype=bfloat16 --sizes 5 9 17 33 --invariant-rows 8 16
    python benchmarks/verify_cost.py +experiment=smollm2 model.dtype=bfloat16 --sizes 9 --prefill 64 128
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from hydra import compose, initialize_config_dir

from weaver.eval.run import load_models
from weaver.models import linear
from weaver.models.linear import prepacked_weights
from weaver.models.target import verify_size
from weaver.pipeline import ROOT_CONF
from weaver.tree import Tree


def under(setting: Callable[[], contextlib.AbstractContextManager], run: Callable[[], object]) -> None:
    with setting():
        run()


@contextlib.contextmanager
def invariant_rows(rows: int, call_rows: int | None = None) -> Iterator[None]:
    """Lossless bf16's matmul calls of `rows` rows (padded to them), at most `call_rows` a call (default `rows`),
    inside the block (the kernel reads the settings per call, so compiled graphs need no rebuild)."""
    before = linear.INVARIANT_ROWS, linear.CALL_ROWS
    linear.INVARIANT_ROWS, linear.CALL_ROWS = rows, call_rows or rows
    try:
        yield
    finally:
        linear.INVARIANT_ROWS, linear.CALL_ROWS = before


def row_setting(text: str) -> str:
    """An --invariant-rows entry, checked: R or R:C, whole numbers >= 1."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected R or R:C (whole numbers >= 1), got '{text}'")
    return text


def random_tree(size: int, vocab: int, generator: torch.Generator) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]
    return Tree(torch.randint(vocab, (size,), generator=generator), torch.tensor(parents))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 5, 9, 17, 33, 65])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--both-linears", action="store_true", help="each forward with and without prepacked weights")
    parser.add_argument("--invariant-rows", type=row_setting, nargs="+",
                        help="each forward with bf16 matmul calls of these rows: R, or R:C (padded to R, at most C a call)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[], help="also time prompts of these lengths")
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, "eval.methods=[ar]"])
    target = load_models(cfg)[0]["target"]
    device = target.embed.weight.device
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(target.cfg.vocab_size, (1, args.context), generator=generator).to(device)
    cache = target.new_cache(1, args.context + verify_size(max(args.sizes)) + 1)
    target(prompt, cache, logits_to_keep=1)
    length, position = cache.length, cache.next_position.clone()
    trees = {size: Tree(t.tokens.to(device), t.parents.to(device))
             for size in args.sizes for t in [random_tree(size, target.cfg.vocab_size, generator)]}
    step = target.decode_fn(cfg.eval.compile)

    def timed(run) -> float:
        cache.length, cache.next_position = length, position.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    runs = {"decode (eager)": lambda: target(prompt[:, :1], cache), "decode (compiled)": lambda: step(prompt[:, :1], cache),
            **{f"verify {size}": (lambda tree=tree: target.verify(tree, cache)) for size, tree in trees.items()}}
    for n in args.prefill:
        ids = torch.randint(target.cfg.vocab_size, (1, n), generator=generator).to(device)
        runs |= {f"prefill {n}": lambda ids=ids: target.prefill(ids, target.new_cache(1, ids.shape[1])),
                 f"prefill {n} (exact)": lambda ids=ids: target(ids, target.new_cache(1, ids.shape[1]), logits_to_keep=1)}
    if cfg.eval.compile:
        runs |= {f"verify {size} (compiled)": (lambda tree=tree: target.verify(tree, cache, compiled=cfg.eval.compile))
                 for size, tree in trees.items()}
    # name -> the setting's context (made anew for every call)
    variants = ({"[prepacked]": lambda: prepacked_weights(True), "[F.linear]": lambda: prepacked_weights(False)}
                if args.both_linears else
                {f"[{rows} rows]": lambda rows=rows: invariant_rows(*map(int, rows.split(":"))) for rows in args.invariant_rows or ()})
    if variants:  # every forward under each setting, interleaved
        runs = {f"{label} {name}": (lambda run=run, setting=setting: under(setting, run))
                for label, run in runs.items() for name, setting in variants.items()}
    times: dict[str, list[float]] = {label: [] for label in runs}
    for label, run in runs.items():  # warm-up: allocation and compilation
        timed(run)
    order = list(runs)
    for _ in range(args.repeats):  # a fresh order each round: a call after another kind of forward runs slower
        for label in [order[i] for i in torch.randperm(len(order), generator=generator)]:
            times[label].append(timed(runs[label]))
    ms = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    print(f"{cfg.experiment}: context {args.context}, {target.embed.weight.dtype}, {device}, compile {cfg.eval.compile}, "
          f"cpu {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| forward | ms | / eager decode | / compiled decode |")
    print("|---|---|---|---|")
    for label, value in ms.items():
        linears = label[label.find(" ["):] if " [" in label else ""  # each row against the decode of its own linears
        eager, compiled = ms[f"decode (eager){linears}"], ms[f"decode (compiled){linears}"]
        print(f"| {label} | {value:.2f} | {value / eager:.2f} | {value / compiled:.2f} |")


if __name__ == "__main__":
    main()
