"""Checkpoints for the tests in this folder, written by weaver in the main environment (tests/test_serving.py:
the reference runs of our own engine need weaver's environment) and handed over in environment variables; and
the requests both environments run."""

import os
from pathlib import Path

import pytest
import torch

TARGET, DRAFTER = "WEAVER_TEST_TARGET", "WEAVER_TEST_DRAFTER"  # a tiny Qwen3 target; a DFlash drafter for it
DRAFT_STEP = "WEAVER_TEST_DRAFT_STEP"  # one drafting step computed in weaver's environment (tests/test_serving.py)
ADAPTER = "WEAVER_TEST_ADAPTER"  # a Weaver adapter for the tiny target and drafter
REFERENCE = "WEAVER_TEST_REFERENCE"  # weaver's own engine on `prompts()`: JSON {method: [per request]}
# the sampling test: 3 tokens per run. At 0.3 the random tiny target spreads its next token over ~40 likely
# tokens (near uniform at 1) and ~9% of the random drafter's drafts are accepted (at 0.1: under 1%, so a run
# of 500 could accept none)
SAMPLED_PROMPT, SAMPLED_RUNS, SAMPLED_TEMPERATURE = [7, 8, 9, 7, 8, 9, 7, 8], 500, 0.3
MAX_NEW_TOKENS, NUM_DRAFT_TOKENS = 24, 16  # SGLang's draft tokens count the tree's root: budget 15


def checkpoint(variable: str) -> Path:
    if variable not in os.environ:
        pytest.skip(f"{variable} is not set: run these tests through tests/test_serving.py")
    return Path(os.environ[variable])


def prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts run one at a time, and a batch run concurrently: random ids, and repeated patterns with
    varied continuations, so that n-gram and drafter trees find drafts the target accepts."""
    gen = torch.Generator().manual_seed(0)
    rand = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 13)]
    patterns = [[7, 8, 9, 7, 8, 9, 7, 8, 10, 7, 8, 11, 7, 8, 9, 7, 8], [5, 6, 5, 6, 5, 7, 5, 6, 5, 8, 5]]
    batch = [[1, 2, 3, 4, 5, 6], [30, 31, 32, 30, 31, 33, 30, 31, 32, 30], rand[0][:4] * 3]
    return rand + patterns, batch
