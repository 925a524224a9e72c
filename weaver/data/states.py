"""`states` stage: the target's states over every rollout, computed once for all training epochs.

Drafter and adapter training read, per token, the target's tapped hidden states (the drafter's context)
and its final-norm state (slot 0 of the adapter; the target's logits are `lm_head` of it). For a
pretrained target that forward is most of a training step (SmolLM2-135M: a 16 x 192-token forward is
~5x the drafter's own step), so `rollouts.store_states: true` runs it once here and training reads the
stored states. They are kept in bf16 (what a GPU trains in anyway), in safetensors shards of
`rollouts.shard_size` rollouts: `shard-NNNNN.safetensors` holds `states` (tokens, taps + 1, hidden) and
`offsets` (rows + 1,); the processes of `accelerate launch` share the shards (`weaver.data.shards`), and a killed
build resumes at the missing ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weaver.data.shards import build_shards
from weaver.errors import WeaverError
from weaver.io import atomic_write_json, durable_rename, fsync_path, fsync_tree, writable_dir
from weaver.models.target import TargetModel

STORED_DTYPE = torch.bfloat16


def right_pad(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """(N, max length) token ids, each sequence left-aligned and followed by `pad_id`."""
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids


@torch.no_grad()  # not inference_mode: the drafter's backward saves these as inputs
def target_states(target: TargetModel, ids: torch.Tensor, tap_layers: tuple[int, ...]) -> torch.Tensor:
    """(N, L, taps + 1, H): the tapped states and the final-norm state of each position of ids (N, L)."""
    out = target(ids, tap_layers=tap_layers, logits_to_keep=0)
    return torch.stack([*out.taps, out.hidden], dim=2)


def build_states(target: TargetModel, rows: datasets.Dataset, tap_layers: tuple[int, ...], shard_size: int,
                 batch_size: int, out_dir: Path, work_dir: Path) -> None:
    """Run the target once over every row (prompt + response: a rollout, or text it reads) and store its
    states, shard by shard."""
    if list(rows["prompt_index"]) != list(range(len(rows))):
        raise WeaverError(f"the rows under {out_dir.name} are not indexed 0..n-1; rebuild them")
    device = target.embed.weight.device
    n_shards = -(-len(rows) // shard_size)
    shards_dir = work_dir / "shards"
    paths = [shards_dir / f"shard-{shard:05d}.safetensors" for shard in range(n_shards)]

    def build(shard: int, path: Path) -> None:
        seqs = _sequences(rows, shard * shard_size, shard_size)
        pieces = []
        for start in range(0, len(seqs), batch_size):
            batch = seqs[start : start + batch_size]
            ids = right_pad(batch, 0)  # causal: real positions never see the padding
            states = target_states(target, ids.to(device), tap_layers).to("cpu", STORED_DTYPE)
            pieces += [states[i, : len(s)] for i, s in enumerate(batch)]
        offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
        writable_dir(shards_dir)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"states": torch.cat(pieces).contiguous(), "offsets": offsets}, str(tmp))
        fsync_path(tmp)
        durable_rename(tmp, path)  # a shard is complete or absent

    if not build_shards("states", paths, build):
        return  # another process publishes the folder
    atomic_write_json(shards_dir / "meta.json", {
        "tap_layers": list(tap_layers), "shard_size": shard_size, "n_rollouts": len(rows),
        "hidden_size": target.cfg.hidden_size, "dtype": str(STORED_DTYPE).removeprefix("torch."),
    })
    writable_dir(out_dir.parent)
    fsync_tree(shards_dir)
    durable_rename(shards_dir, out_dir)  # the finished folder appears at once; no shard is ever copied or lost


def _sequences(rows: datasets.Dataset, first: int, n: int) -> list[list[int]]:
    chunk = rows[first : first + n]
    return [p + r for p, r in zip(chunk["prompt_ids"], chunk["response_ids"])]


class States:
    """The (length, taps + 1, hidden) stored states of row i, and batches of them."""

    def __getitem__(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def batch(self, indices: list[int], length: int) -> torch.Tensor:
        """(N, length, taps + 1, H), zero past each row's end (the right padding of the batch's ids)."""
        rows = [self[i] for i in indices]
        out = torch.zeros(len(rows), length, *rows[0].shape[1:], dtype=rows[0].dtype)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out


class StoredStates(States):
    """Read access to a `states` artifact: the (length, taps + 1, hidden) states of rollout i."""

    def __init__(self, folder: Path, tap_layers: tuple[int, ...]):
        meta_path = Path(folder) / "meta.json"
        if not meta_path.is_file():
            raise WeaverError(f"no stored target states at {folder}; rerun `python train.py` for this experiment")
        self.meta = json.loads(meta_path.read_text())
        if tuple(self.meta["tap_layers"]) != tuple(tap_layers):
            raise WeaverError(f"stored states tap layers {self.meta['tap_layers']}, the drafter taps {list(tap_layers)}")
        self.folder = Path(folder)
        self._open: dict[int, tuple] = {}

    def _shard(self, shard: int) -> tuple:
        if shard not in self._open:
            handle = safe_open(str(self.folder / f"shard-{shard:05d}.safetensors"), framework="pt")
            self._open[shard] = (handle.get_slice("states"), handle.get_tensor("offsets"), handle)
        return self._open[shard]

    def __getitem__(self, index: int) -> torch.Tensor:
        shard, local = divmod(index, self.meta["shard_size"])
        states, offsets, _ = self._shard(shard)
        return states[int(offsets[local]) : int(offsets[local + 1])]

    def __len__(self) -> int:
        return self.meta["n_rollouts"]


class ConcatStates(States):
    """Several stored-states artifacts read as one: row i runs through the first's rows, then the next's
    (the order in which their datasets are concatenated)."""

    def __init__(self, parts: list[StoredStates]):
        self.parts = parts
        self.starts = torch.tensor([0] + [len(p) for p in parts]).cumsum(0).tolist()

    def __getitem__(self, index: int) -> torch.Tensor:
        part = next(k for k in range(len(self.parts)) if index < self.starts[k + 1])
        return self.parts[part][index - self.starts[part]]
