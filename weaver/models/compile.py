"""`torch.compile` for the inference steps (decode, verify, draft, adapter): dynamic shapes, so that one
graph serves every context length, in one of two inductor modes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as shape_config

from weaver.errors import WeaverError

Compile = bool | str
"""How an inference step runs: False eager; True (= "default") or a key of INDUCTOR_MODES compiled."""

# Rounding as eager code rounds: inductor otherwise keeps a fused bf16 chain in fp32 and rounds once, so compiled
# and eager bf16 steps differ, and lossless bf16 speculation needs them bitwise equal (`layers.exact_math`).
# fp32 graphs have no such casts.
EAGER_ROUNDING = {"emulate_precision_casts": True}

INDUCTOR_MODES: dict[str, dict[str, Any]] = {
    "default": EAGER_ROUNDING,
    # The weights are frozen into each graph as constants, so inductor can prepack them and benchmark every
    # matmul at compile time between ATen (MKL / oneDNN) and its own C++ GEMM templates, keeping the faster.
    # Batch-1 decoding multiplies 1-65 rows by each weight, where ATen's CPU GEMM repacks the whole weight
    # per call (2.1x slower SmolLM2 decode on an AVX2 EPYC, docs/results.md). A graph's weights must not change
    # after its first call; each graph holds its own packed copy of them.
    "max-autotune": {**EAGER_ROUNDING, "freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
}


def inductor_mode(compiled: Compile) -> str:
    """The INDUCTOR_MODES key of a compile setting that is not False."""
    mode = "default" if compiled is True else compiled
    if not isinstance(mode, str) or mode not in INDUCTOR_MODES:
        raise WeaverError(f"compile: expected false, true or one of {sorted(INDUCTOR_MODES)}; got {compiled!r}")
    return mode


def compile_step(fn: Callable[..., Any], compiled: Compile = True, dynamic: bool = True, **options: Any) -> Callable[..., Any]:
    """`torch.compile(fn, dynamic=dynamic)` in the inductor mode `compiled` names, traced without duck sizing
    (dynamic=False: a graph per input shape, for a step whose shapes a handful of settings fix).
    By default dynamo gives every dimension of the same size at trace time one symbol: a cache length that
    happens to equal a head dimension (say 8) is then specialised together with it, and every later length
    recompiles (the fix torch's own error message names). Both switches are read when a graph is traced
    (inductor's `options=` does not reach freezing), so they are set around each call; the mode is also
    given as `options=`, which makes it part of the backend dynamo's cache matches on (else a function
    compiled in one mode would run that graph in the other)."""
    inductor = INDUCTOR_MODES[inductor_mode(compiled)]
    # a graph per tree size or logit-row bucket (and per model): the default limit of 8 would silently fall
    # back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    graph = torch.compile(fn, dynamic=dynamic, options=inductor or None, **options)

    def run(*args: Any, **kwargs: Any) -> Any:
        with shape_config.patch(use_duck_shape=False), inductor_config.patch(inductor):
            return graph(*args, **kwargs)

    return run
