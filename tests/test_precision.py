"""Precision chosen by the hardware: bf16 autocast only where bf16 matmuls are fast, explicit settings win."""

from __future__ import annotations

import pytest
import torch

from weaver import precision
from weaver.errors import WeaverError


@pytest.fixture
def cpu_where_bf16_is(monkeypatch):
    """Pretend bf16 matmuls take `factor` times as long as fp32 ones on this CPU."""

    def pretend(factor: float) -> None:
        precision.bf16_is_fast.cache_clear()
        seconds = {torch.float32: 1.0, torch.bfloat16: factor}
        monkeypatch.setattr(precision, "_matmul_seconds", lambda dtype: seconds[dtype])

    yield pretend
    precision.bf16_is_fast.cache_clear()


@pytest.mark.parametrize(("factor", "expected"), [(0.4, "bf16"), (1.0, "fp32"), (50.0, "fp32")])
def test_auto_picks_bf16_only_where_it_is_fast(cpu_where_bf16_is, factor, expected):
    cpu_where_bf16_is(factor)
    assert precision.training_precision("auto", torch.device("cpu")) == expected


def test_a_burst_of_other_work_during_one_measurement_does_not_decide(monkeypatch):
    """The first bf16 round is slowed 100x (another process on the machine), the later ones are not."""
    precision.bf16_is_fast.cache_clear()
    bf16_rounds = iter([100.0, 0.4, 0.4])
    monkeypatch.setattr(precision, "_matmul_seconds", lambda dtype: next(bf16_rounds) if dtype == torch.bfloat16 else 1.0)
    try:
        assert precision.bf16_is_fast("cpu")[0]
    finally:
        precision.bf16_is_fast.cache_clear()


def test_auto_says_why(cpu_where_bf16_is):
    cpu_where_bf16_is(50.0)
    fast, reason = precision.bf16_is_fast("cpu")
    assert not fast and "no native bf16" in reason and torch.backends.cpu.get_cpu_capability() in reason


@pytest.mark.parametrize("setting", ["bf16", "fp32"])
def test_explicit_precision_wins(cpu_where_bf16_is, setting):
    cpu_where_bf16_is(50.0)
    assert precision.training_precision(setting, torch.device("cpu")) == setting


def test_the_real_measurement_runs_once_per_process():
    precision.bf16_is_fast.cache_clear()
    first = precision.bf16_is_fast("cpu")
    assert precision.bf16_is_fast("cpu") is first and precision.bf16_is_fast.cache_info().hits == 1


def test_inference_dtype_is_fp32_on_cpu_unless_asked():
    cpu = torch.device("cpu")
    assert precision.inference_dtype("auto", cpu) == torch.float32
    assert precision.inference_dtype("bfloat16", cpu) == torch.bfloat16


@pytest.mark.parametrize(("factor", "expected"), [(0.25, torch.bfloat16), (50.0, torch.float32)])
def test_data_stages_take_bf16_where_it_is_fast_or_the_models_dtype(cpu_where_bf16_is, factor, expected):
    cpu_where_bf16_is(factor)
    cpu = torch.device("cpu")
    assert precision.data_dtype("auto", "auto", cpu) == expected
    assert precision.data_dtype("model", "auto", cpu) == torch.float32  # what rollouts used before the setting
    assert precision.data_dtype("model", "bfloat16", cpu) == torch.bfloat16
    assert precision.data_dtype("float32", "bfloat16", cpu) == torch.float32


@pytest.mark.parametrize(("call", "message"), [
    (lambda: precision.training_precision("fp16x", torch.device("cpu")), "precision must be one of"),
    (lambda: precision.inference_dtype("half", torch.device("cpu")), "model.dtype must be one of"),
    (lambda: precision.data_dtype("bf16", "auto", torch.device("cpu")), "rollouts.dtype must be model or one of"),
    (lambda: precision.resolve_device("tpu"), "device must be auto, cpu or cuda"),
])
def test_bad_settings_are_one_clear_error(call, message):
    with pytest.raises(WeaverError, match=message):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_device_auto_is_the_cpu_without_a_gpu():
    assert precision.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(WeaverError, match="sees no GPU"):
        precision.resolve_device("cuda")


@pytest.mark.parametrize(("factor", "expected"), [(0.25, torch.bfloat16), (50.0, torch.float32)])
def test_the_drafter_takes_bf16_where_it_is_fast_or_the_targets_dtype(cpu_where_bf16_is, factor, expected):
    cpu_where_bf16_is(factor)
    cpu = torch.device("cpu")
    assert precision.drafter_dtype("auto", torch.float32, cpu) == expected
    assert precision.drafter_dtype("model", torch.float32, cpu) == torch.float32
    assert precision.drafter_dtype("model", torch.bfloat16, cpu) == torch.bfloat16
    assert precision.drafter_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    with pytest.raises(WeaverError, match="drafter.dtype must be model, auto, bfloat16"):
        precision.drafter_dtype("bf16", torch.float32, cpu)
