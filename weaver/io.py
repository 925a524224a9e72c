"""Durable, atomic file and folder writes: a crash (or a power cut) never leaves a half-written artifact.

Everything is written under a temporary name, flushed to disk (`fsync` of each file and of the folders
that hold them), then renamed into place, and the rename itself is made durable by an fsync of the
parent folder. A reader therefore sees the old version, or the whole new one, never a torn file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from weaver.errors import WeaverError

TMP_MARK = ".tmp-"  # in the name of every temporary sibling: what `remove_stale_temporaries` clears


def writable_dir(folder: Path) -> Path:
    """Create `folder` if needed; one clear error if that is impossible or it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WeaverError(f"output folder is not writable: {folder} ({err.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise WeaverError(f"output folder is not writable: {folder}")
    return folder


def fsync_path(path: Path) -> None:
    """Flush one file's or folder's contents (a folder's: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, bottom up, before the folder is published by a rename."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def durable_rename(src: Path, dst: Path) -> None:
    """Rename `src` (already flushed) to `dst`, replacing a file there, and make the rename durable."""
    os.replace(src, dst)
    fsync_path(Path(dst).parent)


def report_resume(stage: str, shards: list[Path]) -> None:
    """Say how much of a sharded stage an earlier, killed run finished (its complete shards are kept)."""
    done = sum(path.exists() for path in shards)
    if done:
        print(f"{stage}: resuming, {done} of {len(shards)} shards already done")


def remove_stale_temporaries(target: Path) -> None:
    """Remove temporaries that a killed writer of `target` left beside it (`<name>.tmp-*`)."""
    for stale in Path(target).parent.glob(f"{Path(target).name}{TMP_MARK}*"):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)


@contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; flush it and rename it to `out_dir` only if the block succeeds."""
    out_dir = Path(out_dir)
    writable_dir(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + TMP_MARK, dir=out_dir.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        if out_dir.exists():  # replacing an older artifact: move it aside first
            old = tmp.with_name(tmp.name + ".old")
            out_dir.rename(old)
            durable_rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            durable_rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    writable_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        durable_rename(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def exclusive(lock_file: Path, on_wait: Callable[[str], None] = print) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` for the block, waiting for another process that holds it.

    An advisory `flock`: the kernel drops it with the holder's file descriptor, so a killed holder leaves
    no stale lock behind. `on_wait` hears once who holds it (its pid) before this process waits."""
    lock_file = Path(lock_file)
    writable_dir(lock_file.parent)
    with open(lock_file, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            on_wait(f"waiting for process {f.read().strip() or '?'}, which holds {lock_file}")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
