"""`text` stage: offline text the target reads, extra training data for the drafter (docs/method.md §2.2).

A rollout costs the target one decode step per token; reading text costs it one batched forward for the
whole sequence, ~10x cheaper per token on a CPU (SmolLM2-135M: ~1,100 tokens/s read against ~100 written,
docs/results.md). So besides its own responses the drafter can learn from `drafter.text.n_sequences` windows of
`seq_len` tokens cut from offline corpora (`weaver.data.corpus` sources): the target reads each window once
and its tapped and final-norm states are stored as the `states` stage stores a rollout's. The text is not
the target's, so its tokens are not labels: the drafter learns the target's own distribution there (KL to
the target's next-token distribution at each label position, `weaver.train.drafter.distillation_loss`).

Artifact: `dataset/` (rows as the rollouts': prompt_ids empty, response_ids the window, prompt_index) and
`states/` (a states folder, `weaver.data.states`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import torch
from omegaconf import DictConfig

from weaver.data.corpus import collect_documents
from weaver.data.shards import is_main_process
from weaver.data.states import build_states
from weaver.errors import WeaverError
from weaver.io import atomic_dir, durable_rename
from weaver.models.config import is_count
from weaver.models.target import TargetModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def text_windows(tokenizer: PreTrainedTokenizerBase, sources: Sequence[str], n: int, seq_len: int, seed: int,
                 batch: int = 64) -> list[list[int]]:
    """n windows of seq_len tokens: every document of the corpora cut into non-overlapping windows (in the
    target's tokenizer), the documents taken in a seeded random order until n windows are found."""
    if not sources or not is_count(n) or not is_count(seq_len, 2):
        raise WeaverError(f"drafter.text needs sources, n_sequences >= 1 and seq_len >= 2, got sources={list(sources)}, "
                          f"n_sequences={n!r}, seq_len={seq_len!r}")
    docs = collect_documents(sources)
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    windows: list[list[int]] = []
    for start in range(0, len(order), batch):
        for ids in tokenizer([docs[i]["text"] for i in order[start : start + batch]])["input_ids"]:
            windows += [ids[s : s + seq_len] for s in range(0, len(ids) - seq_len + 1, seq_len)]
        if len(windows) >= n:
            return windows[:n]
    raise WeaverError(f"the corpora {list(sources)} hold {len(windows)} windows of {seq_len} tokens, fewer than "
                      f"drafter.text.n_sequences={n}")


def build_text(target: TargetModel, tokenizer: PreTrainedTokenizerBase, text: DictConfig, tap_layers: tuple[int, ...],
               shard_size: int, batch_size: int, seed: int, out_dir: Path, work_dir: Path) -> None:
    """Cut the windows, let the target read them and store its states; a killed build resumes by shard."""
    windows = text_windows(tokenizer, list(text.sources), text.n_sequences, text.seq_len, seed)
    rows = datasets.Dataset.from_dict({
        "prompt_ids": [[] for _ in windows], "response_ids": windows, "prompt_index": list(range(len(windows))),
    }, features=datasets.Features({
        "prompt_ids": datasets.Sequence(datasets.Value("int64")), "response_ids": datasets.Sequence(datasets.Value("int64")),
        "prompt_index": datasets.Value("int64"),
    }))
    states_dir = work_dir / "states"
    if not states_dir.exists():  # finished by an earlier, interrupted run
        build_states(target, rows, tap_layers, shard_size, batch_size, states_dir, work_dir / "states.work")
    if not is_main_process():  # its share of the states is written; the main process publishes
        return
    with atomic_dir(out_dir) as tmp:
        rows.save_to_disk(str(tmp / "dataset"))
        durable_rename(states_dir, tmp / "states")
    print(f"text: the target read {len(rows)} windows of {text.seq_len} tokens -> {out_dir}")
