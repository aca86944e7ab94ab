"""Strict rotary embedding (neox / Qwen3 layout) on the torch backend."""

from __future__ import annotations

import torch

from rl_kernel.backends.torch.numerics import div_rn, exp64, log64, sincos64


def cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [T, rotary_dim/2] of angle = pos * theta^(-2i/rotary_dim), computed in fp64."""
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = exp64(-div_rn(i, rotary_dim) * log64(torch.full_like(i, float(theta))))
    angle = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    sin, cos = sincos64(angle)
    return cos.to(torch.float32), sin.to(torch.float32)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [T, H, d]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the first rotary_dim dims, fp32."""
    half = rotary_dim // 2
    x32 = x.to(torch.float32)
    x1, x2 = x32[..., :half], x32[..., half:rotary_dim]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x32[..., rotary_dim:]], dim=-1)
    return out.to(x.dtype)
