"""What the benchmarks share: the wall time of one call, a markdown table's header, and their --out files."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from weaver.io import atomic_write_text

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


def write_json(path: str | None, rows: object) -> None:
    """The --out file, when one was asked for: `rows` as indented JSON, written atomically."""
    if path:
        atomic_write_text(Path(path), json.dumps(rows, indent=1) + "\n")
        print(f"rows: {path}")
