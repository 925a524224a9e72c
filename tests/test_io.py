"""Durable atomic writes (weaver/io.py): flushed before they are published, nothing half-written is ever read."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from weaver import io
from weaver.errors import WeaverError
from weaver.eval.results import append_rows, read_rows


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str]]:
    """Every fsync and rename weaver.io makes, in order: (what, path name)."""
    seen: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        seen.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        real_fsync(fd)

    def replace(src, dst) -> None:
        seen.append(("rename", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(io.os, "fsync", fsync)
    monkeypatch.setattr(io.os, "replace", replace)
    return seen


def test_a_file_is_flushed_before_it_is_renamed_and_the_rename_is_flushed(tmp_path, events):
    io.atomic_write_text(tmp_path / "a.json", "{}")
    assert [e for e, _ in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith("a.json" + io.TMP_MARK) and events[1][1] == "a.json" and events[2][1] == tmp_path.name
    assert (tmp_path / "a.json").read_text() == "{}" and os.listdir(tmp_path) == ["a.json"]


def test_a_folder_is_flushed_file_by_file_before_it_appears(tmp_path, events):
    with io.atomic_dir(tmp_path / "artifact") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"x")
        (tmp / "config.json").write_text("{}")
    names = [name for e, name in events if e == "fsync"]
    assert {"weights.bin", "config.json", "sub"} <= set(names[:-1])
    assert events[-2] == ("rename", "artifact") and events[-1] == ("fsync", tmp_path.name)
    assert sorted(p.name for p in (tmp_path / "artifact").rglob("*")) == ["config.json", "sub", "weights.bin"]


def test_a_failed_write_leaves_nothing_and_keeps_the_old_version(tmp_path):
    io.atomic_write_text(tmp_path / "a.txt", "old")
    with pytest.raises(RuntimeError), io.atomic_dir(tmp_path / "folder") as tmp:
        (tmp / "half").write_text("written")
        raise RuntimeError("killed")
    assert sorted(os.listdir(tmp_path)) == ["a.txt"] and (tmp_path / "a.txt").read_text() == "old"


def test_stale_temporaries_of_a_killed_writer_are_removed(tmp_path):
    (tmp_path / f"target-abc{io.TMP_MARK}x1").mkdir()
    (tmp_path / f"target-abc{io.TMP_MARK}x2").write_text("half")
    (tmp_path / "target-abd.tmp-kept").mkdir()  # another artifact's
    io.remove_stale_temporaries(tmp_path / "target-abc")
    assert os.listdir(tmp_path) == ["target-abd.tmp-kept"]


def test_a_malformed_results_line_is_one_clear_error(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"dataset": "a"}\n{"dataset": \n')
    with pytest.raises(WeaverError, match=r"results.jsonl, line 2, is not a JSON row"):
        read_rows(path)


def test_a_run_appends_each_row_once(tmp_path):
    path = tmp_path / "results.jsonl"
    row = {"run_id": "r1", "dataset": "a", "method": "ar", "budget": None, "tau": 1.0}
    append_rows(path, [row])
    append_rows(path, [row, {**row, "method": "chain", "budget": 7}])  # a resumed run appends the dataset again
    append_rows(path, [{**row, "run_id": "r2"}])  # a new run of the same measurement is kept (the summary takes it)
    assert [(r["run_id"], r["method"]) for r in read_rows(path)] == [("r1", "ar"), ("r1", "chain"), ("r2", "ar")]


def test_a_lock_waits_for_its_holder_and_a_killed_holder_leaves_none(tmp_path):
    lock = tmp_path / "locks" / "a.lock"
    hold = "import sys, time; from weaver.io import exclusive\nwith exclusive(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        heard: list[str] = []

        def take_and_release() -> None:
            with io.exclusive(lock, on_wait=heard.append):
                pass

        waiter = threading.Thread(target=take_and_release)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and heard == [f"waiting for process {holder.pid}, which holds {lock}"]
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
        holder.wait()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "the lock of a killed holder is free"
    with io.exclusive(lock, on_wait=heard.append):
        assert len(heard) == 1 and lock.read_text() == str(os.getpid())
