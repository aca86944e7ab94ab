"""Strict SwiGLU on Triton, the torch contract's operations in its order.

round(silu(g) * u), silu(g) = g / (1 + exp32(-g)), exp32 = rl_kernel's fp64 exp rounded to fp32;
fp32 add, IEEE div, mul. Elementwise: an element's bits depend on its own inputs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH, exp64

BLOCK = 1024


@triton.jit(do_not_specialize=["rows"])  # one compile for every row count
def _silu_and_mul_kernel(x_ptr, out_ptr, rows, half, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x 2I passes 2^31 at ~87k tokens of Qwen3-8B's gate_up
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + half + cols, mask=mask, other=0.0).to(tl.float32)
    g32 = g.to(tl.float32)
    e = exp64((-g32).to(tl.float64)).to(tl.float32)
    silu = tl.div_rn(g32, 1.0 + e)
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] in x's dtype, under the contract."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, half = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    if rows and half:
        _silu_and_mul_kernel[(rows, triton.cdiv(half, BLOCK))](
            x2, out, rows, half, x2.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4, **LAUNCH
        )
    return out.reshape(*x.shape[:-1], half)


@triton.jit
def _silu_and_mul_backward_kernel(x_ptr, g_ptr, dx_ptr, half, stride_x, stride_g, stride_d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + half + cols, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    tl.store(
        dx_ptr + row * stride_d + cols,
        (dout * up * sig * (1.0 + gate * (1.0 - sig))).to(dx_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(dx_ptr + row * stride_d + half + cols, (dout * gate * sig).to(dx_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_backward(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """d/dx of silu(x[..., :I]) * x[..., I:] times grad_out, in one pass (fp32 math; no bit contract)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    g2 = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
    rows, half = x2.shape[0], x2.shape[1] // 2
    dx = torch.empty_like(x2)
    if rows and half:
        _silu_and_mul_backward_kernel[(rows, triton.cdiv(half, BLOCK))](
            x2, g2, dx, half, x2.stride(0), g2.stride(0), dx.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return dx.reshape(x.shape)
