"""How a data stage's shards are split over the processes of `accelerate launch` (`weaver.data.shards`), with the
process's rank faked; tests/test_distributed.py runs the real two-process launch."""

from __future__ import annotations

from dataclasses import dataclass

import accelerate
import pytest

from weaver.data.shards import build_shards


@dataclass
class FakeState:
    process_index: int
    num_processes: int

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    is_local_main_process = is_main_process


def as_process(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(accelerate, "PartialState", lambda: FakeState(rank, world))


def build_into(built: list[int]):
    def build(index, path):
        built.append(index)
        path.write_text(str(index))
    return build


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_processes_build_every_shard_once_and_only_the_main_process_merges(tmp_path, monkeypatch, world):
    paths = [tmp_path / "shards" / f"shard-{i:05d}" for i in range(7)]
    paths[0].parent.mkdir()
    built: list[int] = []
    for rank in reversed(range(world)):  # the others first: the main process waits for every shard
        as_process(monkeypatch, rank, world)
        before = len(built)
        merges = build_shards("stage", paths, build_into(built))
        assert merges == (rank == 0)
        assert built[before:] == list(range(rank, 7, world))  # round robin by index
    assert sorted(built) == list(range(7))
    assert [p.read_text() for p in paths] == [str(i) for i in range(7)]


def test_a_resumed_run_builds_only_the_missing_shards_whatever_the_number_of_processes(tmp_path, monkeypatch, capsys):
    paths = [tmp_path / "shards" / f"shard-{i:05d}" for i in range(5)]
    paths[0].parent.mkdir()
    for done in (paths[1], paths[2]):  # finished by an earlier run with another number of processes
        done.write_text("earlier")
    built: list[int] = []
    as_process(monkeypatch, 1, 2)
    assert not build_shards("stage", paths, build_into(built))
    as_process(monkeypatch, 0, 2)
    assert build_shards("stage", paths, build_into(built))
    assert sorted(built) == [0, 3, 4]
    assert paths[1].read_text() == paths[2].read_text() == "earlier"
    assert "resuming, 3 of 5 shards already done" in capsys.readouterr().out  # shard 3 came from the other process


def test_the_main_process_waits_for_the_shards_of_the_others(tmp_path, monkeypatch):
    paths = [tmp_path / "shards" / f"shard-{i:05d}" for i in range(2)]
    paths[0].parent.mkdir()
    as_process(monkeypatch, 0, 2)
    polls: list[int] = []

    def sleep(_):  # the other process finishes its shard while the main one polls
        polls.append(1)
        paths[1].write_text("other")

    monkeypatch.setattr("weaver.data.shards.time.sleep", sleep)
    assert build_shards("stage", paths, build_into([]))
    assert polls == [1] and paths[1].read_text() == "other"
