"""The building blocks our target, drafter and adapter share: RMSNorm, RoPE, the SwiGLU MLP.

Kept apart from `weaver.models.target` so that the drafting side (drafter, adapter, tree builders) imports
without the target's tree-verification kernels, e.g. inside SGLang's environment, where the name `kernels`
is Hugging Face's package.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from weaver.models.config import TargetConfig
from weaver.models.linear import Linear, exact_bf16_enabled


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; scale = offset + weight (offset 1 for zero-centred Qwen3.5 norms)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    @property
    def scale(self) -> torch.Tensor:
        """The effective per-channel scale, offset included."""
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale, self.eps)


def exact_math(x: torch.Tensor) -> bool:
    """Inference in bf16 on a CPU: the math between matmuls (norms, activations, attention, a GDN layer's conv and
    recurrence or tree solve) then runs in float64 and is rounded back once. A verify pass reads a tree's tokens
    together, decoding reads them one at a time, and eager and compiled code order sums and evaluate exp differently; in float64 those
    differences (~1e-16) vanish in the rounding to bf16 (unless a value lies within them of a rounding
    boundary), so with row-invariant matmuls (`weaver.models.linear.INVARIANT_ROWS`) each position's logits
    are bitwise the same however the tokens are read, and greedy speculation in bf16 is lossless. float32
    keeps its own kernels (fast, and 0 argmax flips measured); GPUs never take this path; `exact_bf16(False)`
    turns it off."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and not torch.is_grad_enabled() and exact_bf16_enabled()


def exact_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`xs` in float64 under `exact_math` (decided by the first) or when one already is (a float64 KV cache), else
    as they are."""
    return tuple(x.double() for x in xs) if exact_math(xs[0]) or any(x.dtype == torch.float64 for x in xs) else xs


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * scale in fp32 (float64 under `exact_math` or for float64 x), cast back. Written out: torch's CPU
    rms_norm is a slower composite, and skipping no-op casts matters in the batch-1 decode loop, which is dispatch-bound."""
    h = x.double() if exact_math(x) else x if x.dtype in (torch.float32, torch.float64) else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (scale if scale.dtype == h.dtype else scale.to(h.dtype))
    return h if h.dtype == x.dtype else h.to(x.dtype)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, T, 1, rotary_dim) for position ids (B, T), in the rotate-half layout."""
    freqs = positions[..., None].float() * inv_freq  # angles in float32, as transformers computes them
    # cos/sin in float64: MKL's float32 cos/sin on CPU are not reproducible across processes (an intra-op
    # thread's first calls may take a less exact path); in float64 that difference does not survive the cast
    half = freqs[:, :, None, :].double()
    cos, sin = (half.cos() * scale).to(dtype), (half.sin() * scale).to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # each half-width table computed once


class Rotary(nn.Module):
    """RoPE tables from inverse frequencies that stay fp32 when the model is cast, as transformers keeps them: in
    bf16 they are 0.2% off, about a radian of angle by position 500."""

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)  # moved with the model, never cast
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.inv_freq, self.scale, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` channels of (B, T, H, D); the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if exact_math(gate):
            return self.down((F.silu(gate.double()) * up.double()).to(gate.dtype))
        return self.down(F.silu(gate) * up)


def init_weights(model: torch.nn.Module, std: float) -> None:
    """Fresh weights for a model with `layers` (target, drafter, adapter): Normal(0, std) for matrices and
    embeddings; residual-branch outputs scaled by depth (GPT-2 style)."""
    scaled = std / math.sqrt(2 * len(model.layers))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=scaled if name.endswith((".o", "out_proj", "mlp.down")) else std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=std)
