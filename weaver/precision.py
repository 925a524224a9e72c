"""Numeric precision chosen by the hardware, decided once per process and printed once.

Our CPUs differ: with native bf16 (AVX512-BF16, AMX) a bf16 matmul is about 2x an fp32 one, without it
(AVX2 only) bf16 is emulated and about 50x *slower*. `auto` therefore measures instead of assuming.
"""

from __future__ import annotations

import functools
import time

import torch

from weaver.errors import WeaverError

PRECISIONS = ("auto", "bf16", "fp32")
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_FAST_ENOUGH = 1.3  # bf16 must beat fp32 matmuls by this factor to be worth its casts


def resolve_device(setting: str) -> torch.device:
    """`auto` = CUDA when present, else CPU; an explicit `cuda` without a GPU is one clear error."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting not in ("cpu", "cuda"):
        raise WeaverError(f"device must be auto, cpu or cuda, not '{setting}'")
    if setting == "cuda" and not torch.cuda.is_available():
        raise WeaverError("device=cuda but torch sees no GPU (device=auto falls back to the CPU)")
    return torch.device(setting)


def training_precision(setting: str, device: torch.device) -> str:
    """Autocast precision of a training stage: `bf16` or `fp32`; `auto` picks bf16 only where it is fast."""
    if setting not in PRECISIONS:
        raise WeaverError(f"precision must be one of {', '.join(PRECISIONS)}, not '{setting}'")
    if setting != "auto":
        return setting
    fast, reason = bf16_is_fast(device.type)
    choice = "bf16" if fast else "fp32"
    _announce(f"precision: {choice} ({reason})")
    return choice


def inference_dtype(setting: str, device: torch.device) -> torch.dtype:
    """Weights' dtype for decoding and rollouts: `auto` is bf16 on a GPU and fp32 on a CPU.

    fp32 on a CPU, where every result of this repository was measured. `bfloat16` is lossless there too
    (`weaver.models.layers.exact_math`), attention-only and hybrid GDN targets alike, and decodes SmolLM2 1.4x faster
    where bf16 is native (README: "Precision follows the hardware")."""
    if setting not in DTYPES:
        raise WeaverError(f"model.dtype must be one of {', '.join(DTYPES)}, not '{setting}'")
    if setting != "auto":
        return DTYPES[setting]
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    _announce(f"inference dtype: {str(dtype).removeprefix('torch.')} ({device.type})")
    return dtype


def drafter_dtype(setting: str, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Weights' dtype of the drafter at inference (`drafter.dtype`): `model` = the target's; `auto` = bf16 where
    bf16 matmuls are fast, else the target's. The draft only proposes (the target verifies every token), so
    its rounding never touches losslessness, and its block of 16 positions is a multi-row matmul, where
    native bf16 pays at batch 1 too (docs/results.md: the drafter in bf16)."""
    if setting == "model":
        return target_dtype
    if setting == "auto":
        fast, reason = bf16_is_fast(device.type)
        dtype = torch.bfloat16 if fast else target_dtype
        _announce(f"drafter dtype: {str(dtype).removeprefix('torch.')} ({reason})")
        return dtype
    if setting not in DTYPES or DTYPES[setting] is None:
        raise WeaverError(f"drafter.dtype must be model, auto, {', '.join(k for k in DTYPES if k != 'auto')}, "
                          f"not '{setting}'")
    return DTYPES[setting]


def data_dtype(setting: str, model_setting: str, device: torch.device) -> torch.dtype:
    """Weights' dtype for the data stages (rollouts, stored states): `model` = the model's inference dtype;
    `auto` = bf16 where it is fast. The data feed training, which never needs AR decoding's bit-closeness, and
    a batched rollout is matmul-bound (not latency-bound like batch-1 decoding), so native bf16 pays there."""
    if setting == "model":
        return inference_dtype(model_setting, device)
    if setting == "auto":
        dtype = auto_data_dtype(device)
        _announce(f"rollouts dtype: {str(dtype).removeprefix('torch.')} ({bf16_is_fast(device.type)[1]})")
        return dtype
    if setting not in DTYPES:
        raise WeaverError(f"rollouts.dtype must be model or one of {', '.join(DTYPES)}, not '{setting}'")
    return DTYPES[setting]


def auto_data_dtype(device: torch.device) -> torch.dtype:
    """What `rollouts.dtype: auto` resolves to on this machine: bf16 where it is fast, else fp32."""
    return torch.bfloat16 if bf16_is_fast(device.type)[0] else torch.float32


@functools.cache
def bf16_is_fast(device_type: str) -> tuple[bool, str]:
    """(bf16 worth using, why): CUDA asks the driver; a CPU times one training-sized matmul in both dtypes."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(), "cuda"
    capability = torch.backends.cpu.get_cpu_capability()
    # rounds of both dtypes in turn, the fastest of each: a burst of other work on the machine (a pip
    # install once made native bf16 read 0.2x here) slows one round, not every round of one dtype
    seconds = {dtype: [] for dtype in (torch.float32, torch.bfloat16)}
    for _ in range(3):
        for dtype, times in seconds.items():
            times.append(_matmul_seconds(dtype))
    speedup = min(seconds[torch.float32]) / min(seconds[torch.bfloat16])
    native = "native bf16" if speedup >= _FAST_ENOUGH else "no native bf16"
    return speedup >= _FAST_ENOUGH, f"cpu {capability}, {native}: bf16 matmul {speedup:.2g}x fp32"


def _matmul_seconds(dtype: torch.dtype, size: int = 512, repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # first call pays for the kernel's set-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed run: other processes only ever add time


@functools.cache
def _announce(line: str) -> None:
    print(line, flush=True)
