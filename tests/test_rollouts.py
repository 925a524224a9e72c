"""The `rollouts` stage's generation: shards, sampled rollouts with several responses per prompt."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from hf_tiny import VOCAB
from weaver.data.rollouts import generate_rollouts
from weaver.errors import WeaverError


def settings(**changes) -> OmegaConf:
    base = dict(prompt_tokens=8, max_new_tokens=6, temperature=1.0, samples_per_prompt=1, batch_size=4, shard_size=3)
    return OmegaConf.create({**base, **changes})


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (8,), generator=g).tolist() for _ in range(n)]


def test_several_samples_per_prompt_are_consecutive_rows(target, tmp_path):
    generate_rollouts(target, prompts(3), settings(samples_per_prompt=3), None, 0, tmp_path / "out", tmp_path / "work")
    rows = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))
    assert rows["prompt_index"] == list(range(9))
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["n_rollouts"] == 9 and stats["dtype"] == str(target.embed.weight.dtype).removeprefix("torch.")
    assert [rows[i]["prompt_ids"] for i in range(9)] == [p for p in prompts(3) for _ in range(3)]
    for first in (0, 3, 6):  # a random tiny target at temperature 1: a prompt's samples differ
        assert len({tuple(rows[first + k]["response_ids"]) for k in range(3)}) > 1


def test_greedy_rollouts_take_one_response_per_prompt(target, tmp_path):
    with pytest.raises(WeaverError, match="samples_per_prompt must be a whole number >= 1, and 1 when greedy"):
        generate_rollouts(target, prompts(2), settings(temperature=0.0, samples_per_prompt=2), None, 0,
                          tmp_path / "out", tmp_path / "work")
