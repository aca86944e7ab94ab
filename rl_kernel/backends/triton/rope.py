"""Strict rotary embedding on Triton (neox / Qwen3 layout), the torch contract's operations.

(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, each product and sum rounded (no FMA),
rounded once to x's dtype. cos/sin are the torch backend's fp32 values: read from a table
(`rotate`), or computed in the kernel from each token's position (`rotate_at`) by the twins of the
torch backend's fp64 exp64 / log64 / sincos64, the same operations in the same order, so the same
bits without the ~100 small launches that building the table takes. Dims past rotary_dim pass
through unchanged.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH, exp64, f64, log64, sincos64


@triton.jit
def _cos_sin_at(pos_ptr, t, theta_bits, i, ROTARY: tl.constexpr):
    """The torch backend's fp32 cos, sin of angle pos[t] * theta^(-2i / ROTARY), in fp64 as its cos_sin."""
    theta = theta_bits.to(tl.int64).to(tl.float64, bitcast=True)
    two_i = (2 * i).to(tl.float64)
    inv_freq = exp64(-(two_i / f64(ROTARY)) * log64(tl.zeros_like(two_i) + theta))
    sin, cos = sincos64(tl.load(pos_ptr + t).to(tl.float64) * inv_freq)
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    out_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    theta_bits,
    HALF: tl.constexpr,
    ROTARY: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    AT_POSITIONS: tl.constexpr,
):
    """AT_POSITIONS: cos/sin from pos[t] and theta (its fp64 bits); otherwise from the tables' row t."""
    t = tl.program_id(0).to(tl.int64)  # T x H x d passes 2^31 at 524k tokens of 32 x 128 query heads
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    if AT_POSITIONS:
        c, s = _cos_sin_at(pos_ptr, t, theta_bits, i, ROTARY)
        c, s = c[None, :], s[None, :]
    else:
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
    cos, sin = cos.contiguous(), sin.contiguous()
    return _launch(x, rotary_dim, cos, sin, None, 0.0, cos.stride(0))


def rotate_at(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """x [T, H, d] rotated at positions [T] (int, >= 0) with the contract's cos/sin computed in the kernel: the bits
    of `rotate(x, *cos_sin(positions, rotary_dim, theta), rotary_dim)`. Returns x's shape and dtype."""
    if theta <= 0:
        raise ValueError(f"rope theta must be > 0, got {theta}")
    return _launch(x, rotary_dim, None, None, positions.contiguous(), theta, 0)


def _launch(x, rotary_dim, cos, sin, positions, theta, stride_c) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t == 0 or h == 0:
        return out
    half = rotary_dim // 2
    block_h = min(16, triton.next_power_of_2(h))
    theta_bits = struct.unpack("<q", struct.pack("<d", float(theta)))[0]  # fp64 bits: a Python float arg is fp32
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x,
        cos,
        sin,
        positions,
        out,
        h,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        stride_c,
        theta_bits,
        HALF=half,
        ROTARY=rotary_dim,
        D=d,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)),
        AT_POSITIONS=positions is not None,
        num_warps=4,
        **LAUNCH,
    )
    return out
