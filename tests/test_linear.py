"""Prepacked linear layers (weaver.models.linear) against F.linear, their reference, over random shapes."""

from __future__ import annotations

import copy as copy_module
import io

import pytest
import torch
import torch.nn.functional as F

from weaver.models import linear as linear_module
from weaver.models.linear import Linear, linear, packed_copy, prepacked_weights

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN (mkldnn) not built in")


@pytest.fixture(autouse=True)
def _pack_every_weight(monkeypatch):
    """Small test weights take the fast path too (in models only large ones do)."""
    monkeypatch.setattr(linear_module, "PACK_MIN_ELEMENTS", 0)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_prepacked_equals_f_linear_over_random_shapes(dtype):
    generator = torch.Generator().manual_seed(1)
    for trial in range(12):
        rows, k, n = (int(torch.randint(lo, hi, (1,), generator=generator)) for lo, hi in [(1, 70), (1, 300), (1, 600)])
        lead = (rows,) if trial % 2 else (1, rows)  # 2-D and 3-D inputs
        x = torch.randn(*lead, k, generator=generator).to(dtype)
        weight = torch.randn(n, k, generator=generator).to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype) if trial % 3 else None
        out = linear(x, weight, bias)
        # bf16 is packed only where oneDNN has bf16 kernels (not on an AVX2-only CPU): F.linear elsewhere
        assert (packed_copy(weight) is not None) == (dtype in linear_module.PACKED_DTYPES), "wrong path taken"
        assert out.shape == (*lead, n) and out.dtype == dtype
        torch.testing.assert_close(out, F.linear(x, weight, bias), **TOL[dtype])


def heavy_tailed(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=generator)
    return (x * torch.exp(2 * torch.randn(rows, k, generator=generator))).bfloat16()


@pytest.fixture(params=["onednn", "float64"])
def bf16_kernels(request, monkeypatch):
    """Both ways of running the target's bf16 products: oneDNN's kernels, and float64 as on a CPU without them."""
    if request.param == "float64":
        monkeypatch.setattr(linear_module, "_ONEDNN_BF16", False)
        monkeypatch.setattr(linear_module, "PACKED_DTYPES", (torch.float32,))
    elif torch.bfloat16 not in linear_module.PACKED_DTYPES:
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    return request.param


@torch.inference_mode()
@pytest.mark.parametrize("shape", [(576, 576), (960, 576), (576, 1536), (4096, 576), (200, 300)])
def test_bf16_rows_are_bitwise_their_one_row_products(shape, bf16_kernels):
    """Lossless bf16 speculation rests on this: however many rows one call multiplies, each output row is the
    row a one-row call gives (every bf16 product runs in zero-padded calls of INVARIANT_ROWS rows, or in float64
    where oneDNN has no bf16 kernels)."""
    generator = torch.Generator().manual_seed(shape[0])
    weight = (0.05 * torch.randn(shape, generator=generator)).bfloat16()
    x = heavy_tailed(80, shape[1], generator)
    one_by_one = torch.cat([linear(row, weight, row_invariant=True) for row in x.split(1)])
    for rows in (2, 7, 8, 9, 15, 16, 17, 33, 65, 80):
        assert torch.equal(linear(x[:rows], weight, row_invariant=True), one_by_one[:rows]), f"{rows} rows"
        assert torch.equal(linear(x[None, :rows], weight, row_invariant=True)[0], one_by_one[:rows]), f"{rows} rows, 3-D"
    bias = torch.randn(shape[0], generator=generator).bfloat16()
    torch.testing.assert_close(linear(x, weight, bias, row_invariant=True), F.linear(x, weight, bias), **TOL[torch.bfloat16])
    assert (packed_copy(weight).dtype == torch.float64) == (bf16_kernels == "float64")


@torch.inference_mode()
def test_a_weight_whose_wide_calls_round_differently_keeps_narrow_calls(monkeypatch):
    """Calls of CALL_ROWS rows are used only where the packing's probe finds them rounding every row as
    INVARIANT_ROWS-row calls do: a kernel that rounds wider calls differently (simulated: one output moved by a
    bf16 step) leaves the weight's products in narrow calls, still bitwise its one-row products."""
    if torch.bfloat16 not in linear_module.PACKED_DTYPES:
        pytest.skip("oneDNN has no bf16 kernels on this CPU (bf16 products run in float64)")
    narrow = linear_module.INVARIANT_ROWS
    monkeypatch.setattr(linear_module, "CALL_ROWS", 2 * narrow)
    product = linear_module._packed_product

    def wide_rounds_differently(x, packed, bias):
        out = product(x, packed, bias)
        if len(x) > narrow:
            out.view(torch.int16)[-1, -1] += 1  # the next bf16 number
        return out

    generator = torch.Generator().manual_seed(0)
    weight = (0.05 * torch.randn(96, 64, generator=generator)).bfloat16()
    x = heavy_tailed(5 * narrow, 64, generator)
    one_by_one = torch.cat([linear(row, weight, row_invariant=True) for row in x.split(1)])
    monkeypatch.setattr(linear_module, "_packed_product", wide_rounds_differently)
    for rows in (narrow + 1, 2 * narrow, 5 * narrow):
        assert torch.equal(linear(x[:rows], weight, row_invariant=True), one_by_one[:rows]), f"{rows} rows"
    assert linear_module._call_rows(weight) == narrow


@torch.inference_mode()
def test_one_onednn_call_over_many_rows_is_not_row_invariant():
    """Why bf16 products run in fixed-size calls (INVARIANT_ROWS): one call over more rows picks another kernel, which rounds
    some outputs differently from the one-row call (on a Xeon with AMX: a few in 10^5 at SmolLM2's widths above
    32 rows). A CPU whose kernels agree at every row count, or where oneDNN has none for bf16, has nothing to show."""
    if torch.bfloat16 not in linear_module.PACKED_DTYPES:
        pytest.skip("oneDNN has no bf16 kernels on this CPU (bf16 products run in float64)")
    for seed in range(6):
        generator = torch.Generator().manual_seed(seed)
        weight = (0.05 * torch.randn(960, 576, generator=generator)).bfloat16()
        packed = linear_module._packed(weight)
        x = heavy_tailed(80, 576, generator)
        one_by_one = torch.cat([linear_module._packed_product(row, packed, None) for row in x.split(1)])
        if not torch.equal(linear_module._packed_product(x, packed, None), one_by_one):
            rows = torch.cat([linear(row, weight, row_invariant=True) for row in x.split(1)])
            assert torch.equal(linear(x, weight, row_invariant=True), rows)
            return
    pytest.skip("oneDNN's bf16 kernels agree at 1 and 80 rows on this CPU")


@torch.inference_mode()
def test_compiled_equals_eager_and_uses_one_packed_copy():
    layer = Linear(48, 96)
    graph = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (1, 5, 17):
        x = torch.randn(1, rows, 48)
        torch.testing.assert_close(graph(x), F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])
        packed = packed_copy(layer.weight)
        graph(x)
        assert packed_copy(layer.weight) is packed  # packed once, not per call


def test_a_written_weight_is_repacked():
    layer, x = Linear(32, 64, bias=False), torch.randn(3, 32)
    with torch.inference_mode():
        linear(x, layer.weight)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version counter moves
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), **TOL[torch.float32])
    layer.weight.data = torch.randn(64, 32)  # a swapped storage: no version change
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), **TOL[torch.float32])


def test_a_model_with_packed_weights_still_pickles_and_deep_copies():
    layer = Linear(16, 8)
    with torch.inference_mode():
        expected = layer(torch.ones(1, 16))
    assert packed_copy(layer.weight) is not None
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for copy in (torch.load(buffer, weights_only=False), copy_module.deepcopy(layer)):
        with torch.inference_mode():
            torch.testing.assert_close(copy(torch.ones(1, 16)), expected)


def test_training_autocast_and_the_switch_take_f_linear():
    layer, x = Linear(16, 8), torch.randn(4, 16)
    out = layer(x)  # autograd on: the reference path, which has a backward
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(4, 8).T @ x)
    assert packed_copy(layer.weight) is None
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast still casts
    with torch.inference_mode(), prepacked_weights(False):
        layer(x)
    assert packed_copy(layer.weight) is None


@torch.inference_mode()
def test_only_large_weights_are_packed_by_default(monkeypatch):
    monkeypatch.undo()
    small, large = torch.randn(64, 64), torch.randn(1024, 512)
    linear(torch.randn(2, 64), small), linear(torch.randn(2, 512), large)
    assert packed_copy(small) is None and packed_copy(large) is not None


@torch.inference_mode()
def test_a_target_gives_the_same_logits_with_and_without_prepacking(target):
    ids = torch.randint(0, target.cfg.vocab_size, (2, 23))
    with prepacked_weights(False):
        reference = target(ids).logits
    torch.testing.assert_close(target(ids).logits, reference, **TOL[torch.float32])
    assert packed_copy(target.lm_head.weight) is not None
