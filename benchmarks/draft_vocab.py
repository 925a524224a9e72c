"""Choosing `drafter.draft_vocab`: how much of held-out text a draft vocabulary of n tokens covers, and what a
draft costs with it.

    python benchmarks/draft_vocab.py +experiment=smollm2 --sizes 2048 4096 8192 16384

Coverage: the experiment's rollouts are split into a training part and a held-out part twice (a random sixth,
and the last sixth: other prompt families, as evaluation prompts are); the vocabulary is chosen on the
training part as the drafter stage chooses it (responses alone, and mixed with `drafter.draft_vocab_corpus`),
and the table gives the share of held-out response tokens inside it. Cost: a random drafter of the
experiment's shape drafts after a --context-token context, for each vocabulary and the whole one, eager
and compiled (`eval.compile`), interleaved over --repeats rounds; medians in ms. Arguments other than the
options are eval.py overrides.
"""

from __future__ import annotations

import argparse
import random
import statistics

import datasets
import torch
from hydra import compose, initialize_config_dir

from timing import print_table_header, timed
from weaver.models.drafter import Drafter
from weaver.models.drafter_checkpoint import drafter_config, new_drafter_config
from weaver.artifacts import load_target_and_tokenizer
from weaver.pipeline import ROOT_CONF, artifact_dir
from weaver.train.drafter import corpus_token_counts, frequent_tokens, token_counts


def coverage(heldout: torch.Tensor, counts: list[torch.Tensor], n: int) -> float:
    """Share of the held-out tokens (counts) inside the n-token vocabulary chosen from `counts`."""
    return float(heldout[frequent_tokens(counts, n)].sum() / heldout.sum())


def print_coverage(responses: list[list[int]], corpus: torch.Tensor | None, vocab_size: int, sizes: list[int]) -> None:
    """Held-out coverage per vocabulary size, for a random and a last-sixth split of the responses."""
    order = list(range(len(responses)))
    random.Random(0).shuffle(order)
    cut = len(responses) - len(responses) // 6
    splits = {"random sixth": order, "last sixth": list(range(len(responses)))}
    print_table_header("held out", "mixed with", *(f"n={n}" for n in sizes))
    for name, rows in splits.items():
        train = token_counts((responses[i] for i in rows[:cut]), vocab_size)
        heldout = token_counts((responses[i] for i in rows[cut:]), vocab_size)
        sources = {"responses only": [train]} | ({"corpus": [train, corpus]} if corpus is not None else {})
        for label, counts in sources.items():
            print(f"| {name} | {label} | " + " | ".join(f"{coverage(heldout, counts, n):.3f}" for n in sizes) + " |")


@torch.inference_mode()
def print_draft_cost(cfg, target, vocabularies: dict[str, torch.Tensor | None], context: int, depths: list[int],
                     repeats: int) -> None:
    d = cfg.drafter
    drafters = {}
    for label, ids in vocabularies.items():
        torch.manual_seed(0)
        config = new_drafter_config(target, d.num_layers, d.block_size, 0, d.num_taps, intermediate_size=d.intermediate_size,
                                    draft_vocab_size=None if ids is None else len(ids))
        drafter = Drafter(drafter_config(config)).to(target.embed.weight).eval()
        if ids is not None:
            drafter.draft_vocab.copy_(ids)
        cache = drafter.new_cache(1, context + 1)
        taps = [torch.randn(1, context, target.cfg.hidden_size).to(target.embed.weight)] * len(drafter.cfg.target_layer_ids)
        drafter.extend_context(cache, taps, torch.arange(context)[None])
        if cfg.eval.compile:
            drafter.compile_draft(target, set(depths), cfg.eval.compile)
        drafters[label] = (drafter, cache)
    anchor, position = torch.tensor([5]), torch.tensor([context])
    compiled = cfg.eval.compile
    modes = {"eager": False} | ({f"compiled ({compiled})": compiled} if compiled else {})
    times = {(label, mode, depth): [] for label in drafters for mode in modes for depth in depths}
    for _ in range(repeats):
        for (label, mode, depth), series in times.items():
            drafter, cache = drafters[label]
            series.append(timed(lambda: drafter.draft(target, cache, anchor, position, depth, compiled=modes[mode]))[0])
    print_table_header("draft vocabulary", "mode", *(f"depth {depth} (ms)" for depth in depths))
    for label in drafters:
        for mode in modes:
            row = [f"{1000 * statistics.median(times[label, mode, depth]):.1f}" for depth in depths]
            print(f"| {label} | {mode} | " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 15])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=overrides)
    target, tokenizer = load_target_and_tokenizer(cfg)
    V = target.cfg.vocab_size
    responses = datasets.load_from_disk(str(artifact_dir(cfg, "rollouts") / "dataset"))["response_ids"]
    corpus = corpus_token_counts(cfg.drafter.draft_vocab_corpus, tokenizer, V) if cfg.drafter.draft_vocab_corpus else None
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"target vocab {V}, corpora {list(cfg.drafter.draft_vocab_corpus)}")
    print_coverage(responses, corpus, V, args.sizes)
    counts = [token_counts(responses, V)] + ([corpus] if corpus is not None else [])
    print(f"({int((counts[0] > 0).sum())} distinct tokens in {len(responses)} responses)")
    vocabularies = {"whole": None} | {f"n={n}": frequent_tokens(counts, n) for n in args.sizes}
    print_draft_cost(cfg, target, vocabularies, args.context, args.depths, args.repeats)


if __name__ == "__main__":
    main()
