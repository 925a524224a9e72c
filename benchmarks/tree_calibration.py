"""Are a method's draft probabilities calibrated? Greedy decoding of the eval prompts, every tree node whose
parent was reached (the anchor, or a node the target accepted) binned by the probability its parent's child
distribution gave it, against how often the target then accepted it.

    python benchmarks/tree_calibration.py +experiment=smollm2_read --runs ddtree:16 weaver:16

The best-first search ranks paths by products of these probabilities, so where they run high (overconfident)
it builds trees too deep and too narrow; `weaver.train.calibrate` shrinks an adapter's correction by its
held-out loss (docs/results.md: calibration). Arguments other than the options are eval.py overrides; a run may set
weaver.search for itself as in `spec_decode.py` (weaver:16:rescore=2).
"""

from __future__ import annotations

import argparse

import torch
from hydra import compose, initialize_config_dir

from spec_decode import parse_run, with_settings
from timing import print_table_header, write_json
from weaver.data.prompts import eval_prompts
from weaver.eval.run import load_models, speculative_decoder
from weaver.pipeline import ROOT_CONF
from weaver.search import Proposal

BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)


def reached_edges(proposal: Proposal, leaf: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability, accepted) of each node whose parent the target reached: the anchor or the accepted path."""
    path = proposal.tree.path_to(leaf)
    on_path = torch.zeros(len(proposal.tree), dtype=torch.bool)
    on_path[path] = True
    parents = proposal.tree.parents.cpu()
    reached = torch.cat([torch.zeros(1, dtype=torch.bool), on_path[parents[1:].clamp_min(0)]])
    return proposal.edge_probs()[reached], on_path[reached]


def calibration_rows(probs: torch.Tensor, accepted: torch.Tensor) -> list[dict]:
    """Per bin of BINS: nodes, mean probability, share accepted."""
    rows = []
    for lo, hi in zip(BINS, BINS[1:]):
        inside = (probs >= lo) & ((probs < hi) if hi < 1 else (probs <= hi))
        if inside.any():
            rows.append({"bin": [lo, hi], "nodes": int(inside.sum()), "predicted": float(probs[inside].mean()),
                         "accepted": float(accepted[inside].float().mean())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["ddtree:16", "weaver:16"])
    parser.add_argument("--out", help="write the rows as JSON to this file")
    args, overrides = parser.parse_known_args()
    runs = {label: parse_run(label) for label in args.runs}
    methods = sorted({method for method, *_ in runs.values()})
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, "eval.temperature=0", f"eval.methods=[ar,{','.join(methods)}]"])
    e = cfg.eval
    models, tokenizer = load_models(cfg)
    prompts = [p for ids in eval_prompts(cfg, tokenizer).values() for p in ids]
    print(f"{cfg.experiment}: {len(prompts)} prompts x {e.max_new_tokens} new tokens, greedy, "
          f"cpu {torch.backends.cpu.get_cpu_capability()}")
    results = {}
    for label, (method, budget, settings) in runs.items():
        edges: list[tuple[torch.Tensor, torch.Tensor]] = []
        decode = speculative_decoder(models, with_settings(cfg, settings), method, tokenizer.eos_token_id, None,
                                     on_step=lambda proposal, leaf, logits: edges.append(reached_edges(proposal, leaf)))
        steps = sum(len(decode(prompt, budget)[1].accepted) for prompt in prompts)
        probs, accepted = (torch.cat(x) for x in zip(*edges))
        results[label] = {"tau": 1 + int(accepted.sum()) / steps, "bins": calibration_rows(probs, accepted)}
        print(f"\n{label}: τ {results[label]['tau']:.3f} over {steps} steps (pooled over prompts)")
        print_table_header("draft probability", "nodes", "mean probability", "accepted")
        for row in results[label]["bins"]:
            lo, hi = row["bin"]
            print(f"| {lo:.2f}-{hi:.2f} | {row['nodes']} | {row['predicted']:.3f} | {row['accepted']:.3f} |")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
