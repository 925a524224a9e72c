"""Atomic file and folder writes: a crash never leaves a half-written artifact behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from weaver.errors import WeaverError


def writable_dir(folder: Path) -> Path:
    """Create `folder` if needed; one clear error if that is impossible or it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WeaverError(f"output folder is not writable: {folder} ({err.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise WeaverError(f"output folder is not writable: {folder}")
    return folder


@contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `out_dir` only if the block succeeds."""
    out_dir = Path(out_dir)
    writable_dir(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():  # replacing an older artifact: move it aside first
            old = tmp.with_name(tmp.name + ".old")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    writable_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
