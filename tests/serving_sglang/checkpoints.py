"""Checkpoints for the tests in this folder, written by weaver in the main environment (tests/test_serving.py:
weaver's model code imports our `kernels/`, which Hugging Face's `kernels` package, an SGLang dependency,
shadows in .venv-sglang) and handed over in environment variables."""

import os
from pathlib import Path

import pytest

TARGET, DRAFTER = "WEAVER_TEST_TARGET", "WEAVER_TEST_DRAFTER"  # a tiny Qwen3 target; a DFlash drafter for it


def checkpoint(variable: str) -> Path:
    if variable not in os.environ:
        pytest.skip(f"{variable} is not set: run these tests through tests/test_serving.py")
    return Path(os.environ[variable])
