"""Strict RMSNorm on Triton, the torch contract's operations in the torch contract's order.

y = round(round(x * r) * w), r = 1 / sqrt(sum(x * x) / D + eps) in fp32 with IEEE div and sqrt;
the sum of squares in blocks of 64 (pairwise tree inside a block, blocks left to right). A
program normalises BLOCK_T rows; a row's bits depend on that row only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH, tree_sum

BLOCK_T = 8
SMALL_T = 2048  # up to this many rows: one row per program


@triton.jit(do_not_specialize=["T"])  # row counts vary per batch: one compile for all (see warm-up)
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, T, D, stride_x, stride_y, eps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # T x D passes 2^31 (int64 once, outside the loops)
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, 64)
    acc = tl.zeros((BLOCK_T,), tl.float32)
    for d0 in range(0, D, 64):
        mask = row_ok[:, None] & ((d0 + cols) < D)[None, :]
        x = tl.load(x_rows + d0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        block = tree_sum(x * x, 6)
        acc = tl.where(d0 == 0, block, acc + block)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(acc, D.to(tl.float32)) + eps))
    for d0 in range(0, D, BLOCK_D):
        c = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (c < D)[None, :]
        x = tl.load(x_rows + c[None, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * r[:, None]).to(x.dtype)
        y = (normed.to(tl.float32) * w[None, :]).to(x.dtype)
        tl.store(y_rows + c[None, :], y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] under the contract; returns x's shape and dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t, d = x2.shape
    y = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t:
        # a row's bits depend on that row only, so the rows per program are free: one per program for the few
        # rows of a decode batch (8 per program would leave most of the GPU idle there)
        block_t = BLOCK_T if t > SMALL_T else 1
        _rms_norm_kernel[(triton.cdiv(t, block_t),)](
            x2,
            weight.contiguous(),
            y,
            t,
            d,
            x2.stride(0),
            y.stride(0),
            eps,
            BLOCK_T=block_t,
            BLOCK_D=min(1024, triton.next_power_of_2(d)),
            num_warps=4,
            **LAUNCH,
        )
    return y.reshape(x.shape)


@triton.jit
def _rms_norm_backward_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    dx_ptr,
    dw_ptr,
    T,
    D,
    eps,
    stride_x,
    stride_dy,
    stride_dx,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows in blocks of BLOCK_T, programs striding over the blocks; dw partial per program (fp32)."""
    pid, progs = tl.program_id(0), tl.num_programs(0)
    c = tl.arange(0, BLOCK_D)
    c_ok = c < D
    w = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(pid * BLOCK_T, T, progs * BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        mask = (rows < T)[:, None] & c_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        xhat = x * rstd[:, None]
        gxhat = dy * w[None, :]
        dx = rstd[:, None] * (gxhat - xhat * (tl.sum(gxhat * xhat, 1) / D)[:, None])
        tl.store(dx_ptr + r64 * stride_dx + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, 0)
    tl.store(dw_ptr + pid.to(tl.int64) * D + c, dw, mask=c_ok)


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad_y: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of y = weight * x / rms(x) in one pass over the rows (fp32 math; no bit contract)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    dy = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
    t, d = x2.shape
    block_d = triton.next_power_of_2(d)
    block_t = max(1, min(64, 4096 // block_d))
    progs = max(1, min(triton.cdiv(t, block_t), 1024))
    dx = torch.empty_like(x2)
    dw = torch.empty(progs, d, dtype=torch.float32, device=x.device)
    if t:
        _rms_norm_backward_kernel[(progs,)](
            x2,
            weight.contiguous(),
            dy,
            dx,
            dw,
            t,
            d,
            eps,
            x2.stride(0),
            dy.stride(0),
            dx.stride(0),
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            num_warps=8,
        )
    else:
        dw.zero_()
    return dx.reshape(x.shape), dw.sum(0).to(weight.dtype)
