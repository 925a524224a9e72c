"""The shards of a data stage (rollouts, states, text), split over the processes of `accelerate launch`.

A data stage writes its output shard by shard under its work folder, each shard complete or absent, and each
a function of its index alone (its prompts, its seed, its batches), never of which process builds it or when.
So N processes can share the work: process r builds shards r, r + N, r + 2N, ... and the main process, once
every shard exists, merges them into the artifact, which is then the one a single process writes (tested
bitwise, tests/test_distributed.py). A killed run resumes at the missing shards, with any number of
processes. Each shard is built under a lock of its own, so two jobs on the same outputs never write it together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from weaver.io import exclusive, report_resume


def is_main_process() -> bool:
    """Whether this is the process that merges and publishes (the only one outside `accelerate launch`)."""
    from accelerate import PartialState

    return PartialState().is_main_process


def build_shards(stage: str, paths: list[Path], build: Callable[[int, Path], None], poll_s: float = 1.0) -> bool:
    """Call `build(index, path)` for this process's missing shards; returns True in the main process once
    every shard of `paths` exists (it may merge them), False in the others (their part is done).

    Outside `accelerate launch` there is one process, which builds every shard."""
    from accelerate import PartialState

    state = PartialState()
    rank, world = state.process_index, state.num_processes
    mine = range(rank, len(paths), world)
    if state.is_main_process:
        report_resume(stage, paths)
    if world > 1:
        print(f"{stage}: process {rank} of {world} builds shards {rank}, {rank + world}, ... "
              f"({sum(not paths[i].exists() for i in mine)} of its {len(mine)} missing)", flush=True)
    for index in tqdm(mine, desc=f"{stage} (shards)", disable=not state.is_local_main_process):
        path = paths[index]
        if path.exists():  # finished by an earlier, interrupted run
            continue
        with exclusive(path.parent.parent / "locks" / f"{path.name}.lock", on_wait=lambda why: print(f"{stage}: {why}")):
            if not path.exists():  # or by another job while this one waited for the lock
                build(index, path)
    if not state.is_main_process:
        return False
    wait_for(paths, poll_s)
    return True


def wait_for(paths: list[Path], poll_s: float = 1.0) -> None:
    """Return once every path exists (written by other processes). Polling, not a collective, whose timeout
    (30 min) a long stage would exceed; if another process dies, the launcher stops them all."""
    while not all(path.exists() for path in paths):
        time.sleep(poll_s)
