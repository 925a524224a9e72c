"""Backend choice shared by every op: Triton kernels or the pure-torch references.

`WEAVER_KERNELS` = auto (default: Triton iff the tensors are on CUDA), triton (always; on CPU this needs
the Triton interpreter, TRITON_INTERPRET=1 set before the first kernel is imported) or torch. Triton
modules are imported lazily, on first use, so CPU runs never need Triton and the interpreter flag,
which Triton reads when `@triton.jit` runs, is honoured whenever it is set before that first use.

Every op's tree inputs go through `flatten_trees`, which checks them (`check_trees`) before either backend
runs, and every commit checks its leaves (`check_leaves`): bad trees raise `TreeInputError` (a
`ValueError`) on the host instead of hanging or reading out of bounds in a kernel.
"""

from __future__ import annotations

import os
import weakref
from functools import cached_property

import torch

MODES = ("auto", "triton", "torch")


class KernelError(ValueError):
    """Bad input to an op, or a backend that cannot run (`WEAVER_KERNELS`), refused before any launch."""


class TreeInputError(KernelError):
    """Trees the ops cannot walk, refused on the host before any launch (a cyclic parent pointer would
    hang a kernel, a forward or outside one would read garbage)."""


class ParentTree:
    """A tree known by its parent pointers (T,) (node-local, -1 = child of the committed context, checked by
    `check_trees`), with the ancestor matrix the torch paths need. The ops take such an object, or any
    with the same `parents` and `ancestors` (weaver's `Tree` caches both), wherever they take parents."""

    def __init__(self, parents: torch.Tensor):
        self.parents = parents

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """(T, T) bool, [i, j]: node j is an ancestor of node i or i itself; the reflexive-transitive closure
        of the parent relation by repeated squaring (log2 T boolean matmuls)."""
        T = len(self.parents)
        closure = torch.eye(T, device=self.parents.device)
        has_parent = self.parents >= 0
        closure[torch.arange(T, device=self.parents.device)[has_parent], self.parents[has_parent]] = 1.0
        for _ in range(max(T - 1, 1).bit_length()):
            closure = ((closure @ closure) > 0).float()
        return closure.bool()


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensors like `x` runs the Triton kernel."""
    mode = os.environ.get("WEAVER_KERNELS", "auto").lower()
    if mode not in MODES:
        raise KernelError(f"WEAVER_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "torch" or (mode == "auto" and not x.is_cuda):
        return False
    if not x.is_cuda and not interpreting():
        raise KernelError("WEAVER_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before kernels load)")
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (read the way `triton.jit` reads it)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def next_pow2(n: int, floor: int = 16) -> int:
    """Block size for n elements: a power of two, at least `floor` (tl.dot needs block dims >= 16)."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def autotune_configs(configs: list) -> list:
    """Autotune candidates, or just the first when interpreting (the interpreter cannot time kernels)."""
    return configs[:1] if interpreting() else configs


# Tree objects whose parents passed `check_trees` (trees are immutable): the engine hands one tree per
# verify step to every layer's ops, which then skip the device-to-host copy of its parents.
_CHECKED_TREES: weakref.WeakSet = weakref.WeakSet()


def flatten_trees(
    batch: int, length: int, parents: torch.Tensor | ParentTree, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every op's batch-of-trees form, checked by `check_trees`: node-local parent pointers (N,) int32, tree
    offsets (n+1,) int32 and each tree's node count (host, so launches need no device read).

    Without `cu_seqlens`, `parents` (T,) (or a tree object, `ParentTree`) is one tree shared by all `batch` rows of
    (batch, T, ...) inputs; with it, inputs are (1, N, ...) and tree n holds nodes cu_seqlens[n]:cu_seqlens[n+1].
    `length` is the inputs' node count (T, or N with `cu_seqlens`).
    """
    tree = None if isinstance(parents, torch.Tensor) else parents
    if tree is not None:
        parents = tree.parents
    if cu_seqlens is not None and batch != 1:
        raise TreeInputError("invalid tree input: with cu_seqlens (a batch of trees) the inputs must have batch size 1")
    offsets = [0, parents.numel()] if cu_seqlens is None else cu_seqlens.tolist()  # a shared tree: once
    if not (cu_seqlens is None and tree in _CHECKED_TREES and parents.numel() == length):
        check_trees(parents, offsets, length)
        if cu_seqlens is None and tree is not None:
            _CHECKED_TREES.add(tree)
    if cu_seqlens is None:
        return shared_tree(batch, parents)
    lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
    return parents.to(torch.int32).contiguous(), cu_seqlens.to(torch.int32).contiguous(), lengths


def shared_tree(batch: int, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The batch-of-trees form of one tree (T,) shared by `batch` rows: parents repeated, offsets, lengths."""
    T = parents.numel()
    cu_seqlens = torch.arange(0, (batch + 1) * T, T, dtype=torch.int32, device=parents.device)
    return parents.to(torch.int32).repeat(batch), cu_seqlens, [T] * batch


def check_trees(parents: torch.Tensor, offsets: list[int], length: int) -> None:
    """Refuse trees unless `offsets` split the `length` nodes into non-empty trees and, within each tree,
    -1 <= parents[i] < i (topological order, -1 = child of the committed context): then every parent walk
    ends at a root after at most i steps, inside the tree.

    O(N) vector ops on the host after one device-to-host copy of `parents` (N ints), which waits for the
    GPU when they live there (once per tree object, see `_CHECKED_TREES`).
    """
    if parents.dim() != 1:
        raise TreeInputError(f"invalid tree input: parents must be 1-d, got shape {tuple(parents.shape)}")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != length or parents.numel() != length:
        raise TreeInputError(f"invalid tree input: {parents.numel()} parents and tree offsets {offsets} "
                             f"for inputs of {length} nodes")
    lengths = torch.tensor(offsets).diff()
    if bool((lengths <= 0).any()):
        raise TreeInputError(f"invalid tree input: every tree needs at least one node (offsets {offsets})")
    starts = torch.tensor(offsets[:-1]).repeat_interleave(lengths)
    local = torch.arange(length) - starts
    host = parents.cpu().long()
    bad = ((host < -1) | (host >= local)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise TreeInputError(f"invalid tree input: node {int(local[i])} of the tree at offset {int(starts[i])} has "
                             f"parent {int(host[i])}; need -1 <= parent < node (topological order)")


def check_precomputed(tree_tensor: torch.Tensor, length: int, what: str) -> None:
    """A caller's precomputed tree tensor (ancestors, conv windows) must have one row per input node."""
    if tree_tensor.shape[0] != length:
        raise TreeInputError(f"invalid tree input: {what} has {tree_tensor.shape[0]} rows for inputs of {length} nodes")


def check_leaves(leaf: int | list[int] | torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each tree's accepted leaf (node-local) as (n_trees,) int32, refused unless there is one per tree and
    0 <= leaf < that tree's node count (a commit would otherwise read out of bounds or write nothing)."""
    leaves = torch.as_tensor(leaf, dtype=torch.int32).reshape(-1)
    host = leaves.tolist()
    if len(host) != len(lengths) or not all(0 <= node < n for node, n in zip(host, lengths)):
        raise TreeInputError(f"invalid tree input: leaves {host} for trees of {lengths} nodes "
                             "(one per tree, 0 <= leaf < its node count)")
    return leaves


def trees_for_reference(
    parents: torch.Tensor | ParentTree, flat_parents: torch.Tensor, cu_seqlens: torch.Tensor
) -> list[ParentTree]:
    """One tree object per tree of the batch for the torch path; a given one is reused as is, so the
    ancestors and conv windows cached on it are built once per verify step, not once per layer."""
    if not isinstance(parents, torch.Tensor):
        return [parents] * (cu_seqlens.numel() - 1)
    bounds = cu_seqlens.tolist()
    return [ParentTree(flat_parents[s:e].long()) for s, e in zip(bounds[:-1], bounds[1:])]
