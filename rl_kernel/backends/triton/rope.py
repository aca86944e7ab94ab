"""Strict rotary embedding on Triton (neox / Qwen3 layout), the torch contract's operations.

(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, each product and sum rounded (no FMA),
rounded once to x's dtype; cos/sin are the torch backend's fp32 table. Dims past rotary_dim pass
through unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    HALF: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # T x H x d passes 2^31 at 524k tokens of 32 x 128 query heads
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    c = tl.load(cos_ptr + t * stride_c + i, mask=i_ok, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_c + i, mask=i_ok, other=0.0)[None, :]
    base = x_ptr + (t * stride_xt + heads.to(tl.int64)[:, None] * stride_xh)
    obase = out_ptr + (t * stride_ot + heads.to(tl.int64)[:, None] * stride_oh)
    mask = h_ok[:, None] & i_ok[None, :]
    x1 = tl.load(base + i[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + HALF + i[None, :], mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(obase + i[None, :], (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(obase + HALF + i[None, :], (b * c + a * s).to(x1.dtype), mask=mask)
    if D > 2 * HALF:
        j = 2 * HALF + tl.arange(0, BLOCK_D)
        jmask = h_ok[:, None] & (j < D)[None, :]
        tl.store(obase + j[None, :], tl.load(base + j[None, :], mask=jmask, other=0.0), mask=jmask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [T, H, d]; cos, sin fp32 [T, rotary_dim / 2]. Returns x's shape and dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t == 0 or h == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    half = rotary_dim // 2
    block_h = min(16, triton.next_power_of_2(h))
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x,
        cos,
        sin,
        out,
        h,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        HALF=half,
        D=d,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)),
        num_warps=4,
        **LAUNCH,
    )
    return out
