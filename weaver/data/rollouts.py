"""`rollouts` stage: the target answers prompts; drafter and adapter train on its own outputs.

Prompts are openings of a scratch target's corpus rows, or prompt sets rendered in any target's chat
template (`rollouts.prompts: [train_math, train_code, ...]`, conf/prompt_sets).

Stored as an HF `datasets` dataset (Arrow on disk) with columns prompt_ids, response_ids, prompt_index (the
rollout's row: with `samples_per_prompt: k`, at temperature > 0, each prompt's k sampled responses are
consecutive rows).
Generation is batched (left-padded) with our engine and written shard by shard under the stage's work
folder (`weaver.data.shards`: split over the processes of `accelerate launch`), so a killed run resumes at the
missing shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import torch
from omegaconf import DictConfig

from weaver.data.prompts import encode_prompts, load_prompt_set, template_kwargs
from weaver.data.shards import build_shards
from weaver.errors import WeaverError
from weaver.generate import generate
from weaver.io import atomic_dir, atomic_write_json
from weaver.models.config import check_context, is_count

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def corpus_prompts(corpus_dir: Path, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """Openings of `n` random training rows of the target's corpus (its own domain: code)."""
    rows = datasets.load_from_disk(str(corpus_dir / "dataset"))["train"]
    if len(rows) < n:
        raise WeaverError(f"the corpus has {len(rows)} training rows, fewer than rollouts.n_prompts={n}")
    picked = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n].tolist()
    return [row[:prompt_tokens] for row in rows.select(picked)["input_ids"]]


def spread(n: int, available: list[int]) -> list[int]:
    """`n` split as evenly as possible over sets holding `available` rows each: a set with fewer rows than
    its share gives all it has and the rest is spread over the others (the earlier sets take the remainders)."""
    if not is_count(n):
        raise WeaverError(f"rollouts.n_prompts must be a whole number >= 1, got {n!r}")
    if n > sum(available):
        raise WeaverError(f"the prompt sets hold {sum(available)} prompts in all ({', '.join(map(str, available))}), "
                          f"fewer than rollouts.n_prompts={n}")
    shares, open_sets, left = [0] * len(available), list(range(len(available))), n
    while left:
        base, extra = divmod(left, len(open_sets))
        for rank, i in enumerate(open_sets):
            take = min(base + (rank < extra), available[i] - shares[i])
            shares[i] += take
            left -= take
        open_sets = [i for i in open_sets if shares[i] < available[i]]
    return shares


def set_prompts(cfg: DictConfig, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """`rollouts.n_prompts` prompts spread evenly over the prompt sets named in `rollouts.prompts` (`spread`: a
    set that runs short gives all it has), as token ids in the target's chat template (any target: the text is
    rendered by its own tokenizer). Prompts that also occur in a set of `rollouts.exclude` (the evaluation sets)
    are dropped first."""
    r = cfg.rollouts
    names = list(r.prompts)
    if not names:
        raise WeaverError("rollouts.prompts is empty: give 'corpus' or a list of prompt sets")
    banned = {text for name in r.exclude for text in load_prompt_set(cfg, name)["prompt"]}
    sets = [load_prompt_set(cfg, name).filter(lambda text: text not in banned, input_columns="prompt") for name in names]
    prompts = []
    for rows, n in zip(sets, spread(r.n_prompts, [len(rows) for rows in sets])):
        if n:  # fewer prompts than sets leaves the last sets out
            prompts += encode_prompts(rows, tokenizer, n, r.prompt_tokens, "truncate", template_kwargs(cfg))
    return prompts


def generate_rollouts(
    target, prompts: list[list[int]], rollouts: DictConfig, eos_token_id: int | None, seed: int, out_dir: Path,
    work_dir: Path,
) -> None:
    check_context(target.cfg, rollouts.prompt_tokens, rollouts.max_new_tokens, "rollouts.prompt_tokens")
    samples = rollouts.get("samples_per_prompt", 1)
    if not is_count(samples) or (samples > 1 and rollouts.temperature <= 0):
        raise WeaverError(f"rollouts.samples_per_prompt must be a whole number >= 1, and 1 when greedy "
                          f"(rollouts.temperature 0 gives one response per prompt), got {samples!r}")
    prompts = [p for p in prompts for _ in range(samples)]  # a prompt's samples are consecutive rollouts
    shards_dir = work_dir / "shards"
    n_shards = -(-len(prompts) // rollouts.shard_size)
    generator = torch.Generator().manual_seed(seed)

    def build(shard: int, path: Path) -> None:
        generator.manual_seed(seed * 100_003 + shard)  # a shard's samples do not depend on resuming or on its process
        first = shard * rollouts.shard_size
        shard_prompts = prompts[first : first + rollouts.shard_size]
        rows = []
        for start in range(0, len(shard_prompts), rollouts.batch_size):
            batch = shard_prompts[start : start + rollouts.batch_size]
            responses = generate(target, batch, rollouts.max_new_tokens, rollouts.temperature, eos_token_id, generator)
            rows += [
                {"prompt_ids": p, "response_ids": r, "prompt_index": first + start + i}
                for i, (p, r) in enumerate(zip(batch, responses))
            ]
        with atomic_dir(path) as tmp:
            datasets.Dataset.from_list(rows).save_to_disk(str(tmp))

    paths = [shards_dir / f"shard-{shard:05d}" for shard in range(n_shards)]
    if not build_shards("rollouts", paths, build):
        return  # another process merges
    shards = [datasets.load_from_disk(str(path)) for path in paths]
    merged = datasets.concatenate_datasets(shards)
    with atomic_dir(out_dir) as tmp:
        merged.save_to_disk(str(tmp / "dataset"))
        n_tokens = sum(len(r) for r in merged["response_ids"])
        atomic_write_json(tmp / "stats.json", {
            "n_rollouts": len(merged), "response_tokens": n_tokens, "temperature": rollouts.temperature,
            "max_new_tokens": rollouts.max_new_tokens, "dtype": str(target.embed.weight.dtype).removeprefix("torch."),
        })
    print(f"rollouts: {len(merged)} responses, {n_tokens:,} tokens -> {out_dir}")
