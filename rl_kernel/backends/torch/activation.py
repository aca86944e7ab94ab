"""Strict SwiGLU on the torch backend."""

from __future__ import annotations

import torch

from rl_kernel.backends.torch.numerics import exp32


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """round(silu(g) * u) with silu(g) = g / (1 + exp(-g)), all in fp32, exp from numerics."""
    half = x.shape[-1] // 2
    g = x[..., :half].to(torch.float32)
    u = x[..., half:].to(torch.float32)
    silu = g / (1.0 + exp32(-g))
    return (silu * u).to(x.dtype)
