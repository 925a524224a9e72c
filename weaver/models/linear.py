"""Linear layers whose weights are prepacked once for oneDNN when a CPU runs them for inference.

At the row counts of decoding (one token, a tree of 2-65 nodes, a batch of rollouts) a CPU matmul is bound by
reading the weight from memory, and ATen's GEMM re-packs the whole weight on every call for more than one row:
a SmolLM2 verify pass of 5 nodes read its 540 MB of fp32 weights about twice, and 2-3 rows ran as one GEMV each
(docs/results.md: "Prepacked weights"). oneDNN's inner product on a weight reordered once reads it once, for any
number of rows. The packed copy is kept beside the weight tensor and rebuilt when the weight changes (its version
counter); training (autograd on) and other devices take `F.linear`, which stays the reference.

In bf16 the packed product is also *row-invariant*: each output row is bitwise the same however many rows one
call multiplies, which lossless speculation in bf16 needs (a verify pass reads a tree's rows together, decoding
reads one at a time; `weaver.models.layers.exact_math`). oneDNN picks its bf16 kernel by the row count, and the
kernels round a few outputs differently (from 16 to 47 rows at the shapes we probed on a Xeon with AMX, one
output in 10^5 or fewer: not a threshold a probe can find), so every bf16 product runs in calls of exactly
INVARIANT_ROWS rows, zero-padded: one kernel for every row, and a row's result does not depend on its place
in the call (tests/test_linear.py). The call is 16 rows where the CPU has AMX, whose tiles are 16 rows high: there
a SmolLM2 decode step costs 2% more in 16-row than in 8-row calls and a 9-node verify 1.2 decodes instead of 1.7
(two 8-row calls per product); elsewhere 8 rows, which already cost AVX512-BF16 kernels 2-3x one row
(docs/results.md: "Lossless bf16 in 16-row calls"). With AMX one call also takes 32 rows (CALL_ROWS), which round
every row as a 16-row call does and cost 0.5-0.6 of two: a 17-32 node verify 1.3-1.5 decodes instead of 1.7-1.9
(docs/results.md: "Lossless bf16 in 32-row calls"); from 48 rows the kernel changes again. That is a finding about
oneDNN's kernels on the CPUs we measured, not a construction, so each weight's wide calls are probed when it is
first multiplied by more than INVARIANT_ROWS rows (`_call_rows`), and a weight whose probe differs keeps
INVARIANT_ROWS-row calls.
Where oneDNN has no bf16 kernels (an AVX2-only CPU, or a torch built without oneDNN) the row-invariant bf16
products run in float64 instead, on a float64 copy of the weight kept like the packed one: each product of two
bf16 numbers is exact there and a sum's blocking moves it by ~1e-16, which the rounding back to bf16 removes.
Slow (bf16 is the wrong choice on such a CPU: `model.dtype: auto` takes fp32), but lossless on every CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

# the row count oneDNN lays the copy out for: 16 reads as fast as 1 at one row, and 1.6x faster at 5-17 rows
PACKED_FOR_ROWS = 16
# Smaller weights stay with F.linear: they are read quickly anyway, and the packed op's Python kernel outweighs the
# gain (with the plain op registration too: packing every weight made the tiny target's compiled AR 0.71x and its
# DDTree@8 / Weaver@8 0.79x / 0.75x, and changed nothing for SmolLM2, whose small weights are the adapter's;
# docs/results.md: "Prepacked weights")
PACK_MIN_ELEMENTS = (1 << 18) + 1
# the row count of every row-invariant bf16 product: an AMX tile's height where there is one (module docstring)
INVARIANT_ROWS = 16 if torch.cpu._is_amx_tile_supported() else 8
# the most rows one row-invariant call takes (rows padded to INVARIANT_ROWS): 32 with AMX (module docstring)
CALL_ROWS = 2 * INVARIANT_ROWS if torch.cpu._is_amx_tile_supported() else INVARIANT_ROWS
_ONEDNN = torch.backends.mkldnn.is_available()
# oneDNN runs bf16 only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2-only CPU has neither
_ONEDNN_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
PACKED_DTYPES = (torch.float32, torch.bfloat16) if _ONEDNN_BF16 else (torch.float32,)
_enabled = _ONEDNN
_exact = True
# weight -> (what it was packed from, packed copy, its row-invariant call rows by setting: `_call_rows`), by
# identity: beside the weight, not on it, so that a model still pickles and deep-copies (an mkldnn tensor does
# neither); the copy goes when the weight does
_PACKED = WeakIdKeyDictionary()


def use_prepacked_weights(enabled: bool) -> bool:
    """Turn prepacked weights on or off for this process (`eval.prepack`); returns the previous setting.
    Compiled graphs guard on it, so each setting gets its own graph."""
    global _enabled
    before, _enabled = _enabled, enabled and _ONEDNN
    return before


@contextlib.contextmanager
def prepacked_weights(enabled: bool) -> Iterator[None]:
    """`use_prepacked_weights` inside the block only: a test's reference."""
    before = use_prepacked_weights(enabled)
    try:
        yield
    finally:
        use_prepacked_weights(before)


def exact_bf16_enabled() -> bool:
    """Whether bf16 inference on a CPU is made bitwise independent of how tokens are batched (`exact_bf16`)."""
    return _exact


@contextlib.contextmanager
def exact_bf16(enabled: bool) -> Iterator[None]:
    """Inside the block, bf16 inference on a CPU is (True, the default) or is not made row-invariant and exact
    (`weaver.models.layers.exact_math`, INVARIANT_ROWS). The data stages turn it off: they decode batches of
    rollouts, where nothing is compared token for token and a batch of 32 rows would run as 4 calls; so do a
    prompt's prefill (`TargetModel.prefill`), which every decoder runs alike, and the drafter and the Weaver
    adapter, which only propose (`Drafter.draft`, `Drafter.extend_context`, `weaver.builders.weaver_tree`)."""
    global _exact
    before, _exact = _exact, enabled
    try:
        yield
    finally:
        _exact = before


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_invariant: bool = False
) -> torch.Tensor:
    """`F.linear`, through the prepacked weight where that applies (CPU, fp32/bf16, a weight of at least
    PACK_MIN_ELEMENTS, no autograd, no autocast); in bf16 row-invariant if asked (the target's layers ask:
    a drafter or adapter only proposes, and its 16-row blocks would run as two calls), then packed whatever
    the weight's size or `eval.prepack`, since losslessness rests on it."""
    if x.device.type != "cpu" or x.dtype != weight.dtype or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return F.linear(x, weight, bias)
    exact = row_invariant and _exact and x.dtype == torch.bfloat16
    if exact or (_enabled and weight.dtype in PACKED_DTYPES and weight.numel() >= PACK_MIN_ELEMENTS):
        return prepacked_linear(x, weight, bias, exact)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) that runs through `linear`; `row_invariant` set by the model
    that needs it (the target)."""

    row_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.row_invariant)


def _prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_invariant: bool) -> torch.Tensor:
    """The CPU kernel of `prepacked_linear` (below). Batch-1 decoding calls it ~120 times a SmolLM2 token, so each
    torch op here is a few microseconds of every step: the common case pads and slices, nothing else."""
    packed = _packed(weight)
    if packed.dtype == torch.float64:  # a bf16 weight where oneDNN has no bf16 kernels (module docstring)
        return F.linear(x.double(), packed, None if bias is None else bias.double()).to(x.dtype)
    if not row_invariant or x.dtype != torch.bfloat16:  # fp32 is not claimed bitwise row-invariant: one call
        return _packed_product(x, packed, bias)
    rows = x.numel() // x.shape[-1]
    if rows <= INVARIANT_ROWS and x.dim() == 3 and len(x) == 1:  # a decode step, a small tree: the fewest ops
        return _packed_product(F.pad(x, (0, 0, 0, INVARIANT_ROWS - rows)), packed, bias)[:, :rows]
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % INVARIANT_ROWS))
    chunks = padded.split(_call_rows(weight) if rows > INVARIANT_ROWS else INVARIANT_ROWS)
    out = torch.cat([_packed_product(c, packed, bias) for c in chunks]) if len(chunks) > 1 else _packed_product(padded, packed, bias)
    return out[:rows].view(*x.shape[:-1], weight.shape[0])


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# x @ weight.T + bias with oneDNN's packed copy of `weight`, in bf16 row-invariant if asked: an op of its own,
# opaque to torch.compile (the packed tensor, an mkldnn layout, cannot enter a traced graph; the plain weight can).
# Registered with torch.library.Library rather than @custom_op, whose dispatch wrapper costs ~10 us more a call:
# 4-6% of a compiled SmolLM2 decode step, over its 121 products (docs/results.md: "Prepacked weights").
_LIBRARY = torch.library.Library("weaver", "FRAGMENT")  # FRAGMENT: other code may own the namespace too
_LIBRARY.define("prepacked_linear(Tensor x, Tensor weight, Tensor? bias, bool row_invariant) -> Tensor")
_LIBRARY.impl("prepacked_linear", _prepacked_linear, "CPU")


@torch.library.register_fake("weaver::prepacked_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_invariant: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


prepacked_linear = torch.ops.weaver.prepacked_linear.default


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's packed copy, if one was made (and the weight is still alive)."""
    cached = _PACKED.get(weight)
    return None if cached is None else cached[1]


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered for oneDNN (in float64 for a bf16 weight oneDNN cannot run), made once; again when the
    weight was written to since."""
    key = (_version(weight), weight.data_ptr(), weight.dtype, weight.shape)  # `.data =` swaps storage unversioned
    cached = _PACKED.get(weight)
    if cached is None or cached[0] != key:
        cached = _PACKED[weight] = (key, _pack(weight.detach()), {})
    return cached[1]


def _call_rows(weight: torch.Tensor) -> int:
    """How many rows one row-invariant call multiplies by this (packed, bf16) weight: CALL_ROWS if calls that wide
    round every probe row as INVARIANT_ROWS-row calls do, else INVARIANT_ROWS. The probe rows are heavy-tailed, as
    activations are: at SmolLM2's weights they show a 48- or 64-row call's differences for 109 and 113 of 121 weights.
    A probe cannot prove agreement (tests/test_linear.py checks real rows); it keeps a CPU whose wide kernel rounds
    differently from using it. Probed once per packed copy (and setting: a benchmark may change both)."""
    _, packed, probed = _PACKED[weight]
    setting = (INVARIANT_ROWS, CALL_ROWS)
    if setting not in probed:
        probed[setting] = CALL_ROWS if CALL_ROWS == INVARIANT_ROWS or _wide_calls_agree(packed, weight.shape[1]) else INVARIANT_ROWS
    return probed[setting]


def _wide_calls_agree(packed: torch.Tensor, in_features: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * CALL_ROWS, in_features, generator=generator)
    x = (x * torch.exp(2 * torch.randn(x.shape, generator=generator))).to(packed.dtype)
    return all(torch.equal(_packed_product(wide, packed, None),
                           torch.cat([_packed_product(part, packed, None) for part in wide.split(INVARIANT_ROWS)]))
               for wide in x.split(CALL_ROWS))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.bfloat16 and not _ONEDNN_BF16:
        return weight.double()
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor: never written to outside inference mode, and not tracked
        return -1
