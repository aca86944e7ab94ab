"""Strict RMSNorm on the torch backend."""

from __future__ import annotations

import torch

from rl_kernel.backends.torch.numerics import blocked_sum, div_rn, sqrt32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = round(round(x * r) * w), r = 1 / sqrt(sum(x*x) / D + eps) in fp32, each division and the sqrt one IEEE
    operation (on CUDA too: see `div_rn`); sum in blocks of 64."""
    x32 = x.to(torch.float32)
    mean_sq = div_rn(blocked_sum(x32 * x32), x.shape[-1])
    rms = sqrt32(mean_sq + eps)
    inv_rms = torch.ones_like(rms) / rms  # `1.0 / rms` is torch's reciprocal(rms) * 1.0: keep it a division
    normed = (x32 * inv_rms.unsqueeze(-1)).to(x.dtype)
    return (normed.to(torch.float32) * weight.to(torch.float32)).to(x.dtype)


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to x's dtype."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def rms_norm_heads(
    x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, first2: int, eps: float
) -> torch.Tensor:
    """RMSNorm of every head of x [T, H, D], heads h >= first2 scaled by weight2, the others by weight."""
    return torch.cat([rms_norm(x[:, :first2], weight, eps), rms_norm(x[:, first2:], weight2, eps)], dim=1)
