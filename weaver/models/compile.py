"""`torch.compile` for the inference steps (decode, verify, adapter): dynamic shapes, so that one
graph serves every context length."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config as shape_config


def compile_dynamic(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """`torch.compile(fn, dynamic=True)`, traced without duck sizing. By default dynamo gives every dimension
    of the same size at trace time one symbol: a cache length that happens to equal a head dimension (say 8)
    is then specialised together with it, and every later length recompiles (the fix torch's own error
    message names). The switch is read when a graph is traced, so it is set around each call."""
    compiled = torch.compile(fn, dynamic=True, **options)

    def run(*args: Any, **kwargs: Any) -> Any:
        with shape_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return run
