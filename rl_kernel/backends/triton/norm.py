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


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, T, D, stride_x, stride_y, eps,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, 64)
    acc = tl.zeros((BLOCK_T,), tl.float32)
    for d0 in range(0, D, 64):
        mask = row_ok[:, None] & ((d0 + cols) < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + d0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        block = tree_sum(x * x, 6)
        acc = tl.where(d0 == 0, block, acc + block)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(acc, D.to(tl.float32)) + eps))
    for d0 in range(0, D, BLOCK_D):
        c = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (c < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * r[:, None]).to(x.dtype)
        y = (normed.to(tl.float32) * w[None, :]).to(x.dtype)
        tl.store(y_ptr + rows[:, None] * stride_y + c[None, :], y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] under the contract; returns x's shape and dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t, d = x2.shape
    y = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t:
        _rms_norm_kernel[(triton.cdiv(t, BLOCK_T),)](
            x2, weight.contiguous(), y, t, d, x2.stride(0), y.stride(0), eps,
            BLOCK_T=BLOCK_T, BLOCK_D=min(1024, triton.next_power_of_2(d)), num_warps=4, **LAUNCH)
    return y.reshape(x.shape)
