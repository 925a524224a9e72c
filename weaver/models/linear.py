"""Linear layers whose weights are prepacked once for oneDNN when a CPU runs them for inference.

At the row counts of decoding (one token, a tree of 2-65 nodes, a batch of rollouts) a CPU matmul is bound by
reading the weight from memory, and ATen's GEMM re-packs the whole weight on every call for more than one row:
a SmolLM2 verify pass of 5 nodes read its 540 MB of fp32 weights about twice, and 2-3 rows ran as one GEMV each
(docs/results.md: "Prepacked weights"). oneDNN's inner product on a weight reordered once reads it once, for any
number of rows. The packed copy is kept beside the weight tensor and rebuilt when the weight changes (its version
counter); training (autograd on) and other devices take `F.linear`, which stays the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# the row count oneDNN lays the copy out for: 16 reads as fast as 1 at one row, and 1.6x faster at 5-17 rows
PACKED_FOR_ROWS = 16
# Smaller weights stay with F.linear: they are read quickly anyway, and the custom op's Python dispatch (tens of
# microseconds) outweighs the gain (the tiny target's adapter search was 25% slower packed, docs/results.md; the
# adapter's 256 x 1024 MLP weight, 2^18 elements, made each of its calls 60 us slower packed: 0.48 against 0.42 ms)
PACK_MIN_ELEMENTS = (1 << 18) + 1
_enabled = torch.backends.mkldnn.is_available()
# weight -> (what it was packed from, packed copy), by identity: beside the weight, not on it, so that a model
# still pickles and deep-copies (an mkldnn tensor does neither); the copy goes when the weight does
_PACKED = WeakIdKeyDictionary()


def use_prepacked_weights(enabled: bool) -> bool:
    """Turn prepacked weights on or off for this process (`eval.prepack`); returns the previous setting.
    Compiled graphs guard on it, so each setting gets its own graph."""
    global _enabled
    before, _enabled = _enabled, enabled and torch.backends.mkldnn.is_available()
    return before


@contextlib.contextmanager
def prepacked_weights(enabled: bool) -> Iterator[None]:
    """`use_prepacked_weights` inside the block only: a test's reference."""
    before = use_prepacked_weights(enabled)
    try:
        yield
    finally:
        use_prepacked_weights(before)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the prepacked weight where that applies (CPU, fp32/bf16, a weight of at least
    PACK_MIN_ELEMENTS, no autograd, no autocast)."""
    if (_enabled and x.device.type == "cpu" and weight.dtype in PACKED_DTYPES and x.dtype == weight.dtype
            and weight.numel() >= PACK_MIN_ELEMENTS
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")):
        return prepacked_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) that runs through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@torch.library.custom_op("weaver::prepacked_linear", mutates_args=())
def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias with oneDNN's packed copy of `weight`. An opaque op to torch.compile: the packed
    tensor (an mkldnn layout) cannot enter a traced graph, the plain weight can."""
    return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")


@prepacked_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's packed copy, if one was made (and the weight is still alive)."""
    cached = _PACKED.get(weight)
    return None if cached is None else cached[1]


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered for oneDNN, made once; again when the weight was written to since."""
    key = (_version(weight), weight.data_ptr(), weight.dtype, weight.shape)  # `.data =` swaps storage unversioned
    cached = _PACKED.get(weight)
    if cached is None or cached[0] != key:
        cached = _PACKED[weight] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS))
    return cached[1]


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor: never written to outside inference mode, and not tracked
        return -1
