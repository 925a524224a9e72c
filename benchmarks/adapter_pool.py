"""Choosing `weaver.search.pool`: what a trained adapter's distribution reaches on held-out rollouts when it
searches pools of several sizes (its weights do not depend on the pool).

    python benchmarks/adapter_pool.py +experiment=smollm2_t1 --pools 64 512 2048 8192

For each pool M, on the experiment's held-out rollouts (the last `weaver.train.heldout_rollouts`, which the
adapter never saw; `--heldout N` for others), the same metrics as the adapter's training logs: the target's
probability inside the drafter's top-M (`pool_mass`, what any re-scoring of the pool can accept), the
probability that rejection sampling accepts one child drawn at depth 1 from the drafter's own pool
distribution and from the adapter's (`accept_d1_prior`, `accept_d1`), the expected committed tokens of a
one-child chain along the rollout (`tau_rrs_prior`, `tau_rrs`) and greedy top-1 over the pool. Arguments
other than the options are eval.py overrides (the models are the experiment's, as eval.py loads them).
"""

from __future__ import annotations

import argparse

import datasets
import torch
from hydra import compose, initialize_config_dir

from timing import print_table_header
from weaver.data.states import StoredStates
from weaver.models.adapter import with_pool
from weaver.artifacts import load_adapter_for, load_drafter_for, load_target_and_tokenizer
from weaver.pipeline import ROOT_CONF, artifact_dir
from weaver.train.adapter import adapter_loss
from weaver.train.common import heldout_metrics, split_heldout
from weaver.train.drafter import anchored_batches

METRICS = ("pool_mass", "accept_d1_prior", "accept_d1", "tau_rrs_prior", "tau_rrs", "acc_prior", "acc")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--heldout", type=int, default=None, help="default: weaver.train.heldout_rollouts")
    parser.add_argument("--batch-size", type=int, default=2, help="rollouts per batch (a pool of M holds M x rank "
                        "floats per node: keep M x batch modest)")
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(str(ROOT_CONF), version_base="1.3"):
        cfg = compose("eval", overrides=overrides)
    trained_heldout = cfg.weaver.train.get("heldout_rollouts", 0)
    n = args.heldout or trained_heldout
    if not n:
        raise SystemExit("the adapter was trained on every rollout (weaver.train.heldout_rollouts: 0): pass --heldout N "
                         "to measure on the last N anyway (in-sample)")
    target, tokenizer = load_target_and_tokenizer(cfg)
    drafter = load_drafter_for(cfg, target, "model")  # the adapter's training losses, as training computes them
    adapter = load_adapter_for(cfg, target, drafter)
    rows = datasets.load_from_disk(str(artifact_dir(cfg, "rollouts") / "dataset"))
    heldout = split_heldout(rows, n, "--heldout")[1]
    states = StoredStates(artifact_dir(cfg, "states"), drafter.cfg.target_layer_ids) if cfg.rollouts.store_states else None
    train = cfg.weaver.train
    collate = anchored_batches(tokenizer.pad_token_id or 0, train.anchors_per_seq, cfg.seed, states)

    def loss_fn(model, batch):
        ids, lengths, anchors, stored = batch
        return adapter_loss(model, drafter, target, ids, lengths, anchors, train.loss, stored)

    evaluate = heldout_metrics(heldout, collate, loss_fn, args.batch_size, torch.device("cpu"))
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; adapter trained "
          f"on pool {adapter.cfg.pool_size}; {n} held-out rollouts"
          + ("" if n <= trained_heldout else f" ({n - trained_heldout} of them trained on)"))
    print_table_header("pool", *METRICS)
    for pool in args.pools:
        metrics = evaluate(with_pool(adapter, pool))
        print(f"| {pool} | " + " | ".join(f"{metrics[f'heldout_{m}']:.3f}" for m in METRICS) + " |")


if __name__ == "__main__":
    main()
