"""Backend choice shared by every op: Triton kernels or the pure-torch references.

`WEAVER_KERNELS` = auto (default: Triton iff the tensors are on CUDA), triton (always; on CPU this needs
the Triton interpreter, TRITON_INTERPRET=1 set before the first kernel is imported) or torch. Triton
modules are imported lazily, on first use, so CPU runs never need Triton and the interpreter flag,
which Triton reads when `@triton.jit` runs, is honoured whenever it is set before that first use.
"""

from __future__ import annotations

import os

import torch

from weaver.errors import WeaverError
from weaver.tree import Tree

MODES = ("auto", "triton", "torch")


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensors like `x` runs the Triton kernel."""
    mode = os.environ.get("WEAVER_KERNELS", "auto").lower()
    if mode not in MODES:
        raise WeaverError(f"WEAVER_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "torch" or (mode == "auto" and not x.is_cuda):
        return False
    if not x.is_cuda and not interpreting():
        raise WeaverError("WEAVER_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before kernels load)")
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


def flatten_trees(
    batch: int, parents: torch.Tensor | Tree, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every op's batch-of-trees form: node-local parent pointers (N,) int32 and tree offsets (n+1,) int32.

    Without `cu_seqlens`, `parents` (T,) (or a `Tree`) is one tree shared by all `batch` rows of
    (batch, T, ...) inputs; with it, inputs are (1, N, ...) and tree n holds nodes cu_seqlens[n]:cu_seqlens[n+1].
    """
    if isinstance(parents, Tree):
        parents = parents.parents
    if cu_seqlens is None:
        T = parents.shape[-1]
        cu_seqlens = torch.arange(0, (batch + 1) * T, T, device=parents.device)
        parents = parents.repeat(batch)
    elif batch != 1:
        raise WeaverError("with cu_seqlens (a batch of trees) the inputs must have batch size 1")
    return parents.to(torch.int32).contiguous(), cu_seqlens.to(torch.int32).contiguous()


def trees_for_reference(
    parents: torch.Tensor | Tree, flat_parents: torch.Tensor, cu_seqlens: torch.Tensor
) -> list[Tree]:
    """One `Tree` per tree of the batch for the torch path; a given `Tree` is reused as is, so the
    ancestors and conv windows it caches are built once per verify step, not once per layer."""
    if isinstance(parents, Tree):
        return [parents] * (cu_seqlens.numel() - 1)
    bounds = cu_seqlens.tolist()
    return [Tree(flat_parents[s:e].long(), flat_parents[s:e].long()) for s, e in zip(bounds[:-1], bounds[1:])]
