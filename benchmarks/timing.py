"""What the benchmarks share: the wall time of one call, and a markdown table's header."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call of `fn`, counted until a GPU, if one is in use, has finished too."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def print_table_header(*columns: str) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
