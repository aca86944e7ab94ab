"""Strict RMSNorm on Triton, the torch contract's operations in the torch contract's order.

y = round(round(x * r) * w), r = 1 / sqrt(sum(x * x) / D + eps) in fp32 with IEEE div and sqrt;
the sum of squares in blocks of 64 (pairwise tree inside a block, blocks left to right). With a
residual, x is first s = round(x + residual), written out as well. A row's bits depend on that row
only.

Layout, for speed at decode sizes: a program loads its rows whole (in chunks of up to 64 blocks),
reduces every 64-element block at once, and keeps the block sums in a small fp32 scratch; the one
sequential step, the left-to-right fold of the block sums, then reads them back as scalars (one
L1-resident add chain, no memory latency inside it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH, tree_sum

CHUNK_BLOCKS = 64  # 64-element blocks a program holds at once (a 4096-wide chunk of its rows)
TILE = 4096  # elements a program holds at once: rows per program = TILE // its rows' chunk width


@triton.jit(do_not_specialize=["R"])  # row counts vary per batch: one compile for all (see warm-up)
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    w2_ptr,
    y_ptr,
    s_ptr,
    sums_ptr,
    R,
    H,
    W2_FROM,
    stride_xt,
    stride_xh,
    eps,
    D: tl.constexpr,
    NB: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    TWO_WEIGHTS: tl.constexpr,
):
    """Rows r = t * H + h of x (at t * stride_xt + h * stride_xh, unit last stride), scaled by w (TWO_WEIGHTS: by
    w2 where h >= W2_FROM); y, s, residual are contiguous [R, D]; sums is fp32 [R, NB] scratch."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < R  # R x D passes 2^31: offsets in int64 from here on
    x_rows = x_ptr + (rows // H) * stride_xt + (rows % H) * stride_xh
    dense_rows = rows * D  # y, s and residual rows
    sum_rows = sums_ptr + rows * NB
    block = tl.arange(0, CHUNK)
    cols = block[:, None] * 64 + tl.arange(0, 64)[None, :]  # [CHUNK, 64]: block b, lane j
    for b0 in tl.static_range(0, NB, CHUNK):
        c = b0 * 64 + cols
        mask = row_ok[:, None, None] & (c < D)[None, :, :]
        x = tl.load(x_rows[:, None, None] + c[None, :, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            at = dense_rows[:, None, None] + c[None, :, :]
            r = tl.load(res_ptr + at, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(s_ptr + at, x, mask=mask)
        sq = x.to(tl.float32)
        sq = sq * sq
        sums = tl.reshape(tree_sum(tl.reshape(sq, (BLOCK_T * CHUNK, 64)), 6), (BLOCK_T, CHUNK))
        tl.store(sum_rows[:, None] + b0 + block[None, :], sums, mask=row_ok[:, None] & (b0 + block < NB)[None, :])
    tl.debug_barrier()  # the block sums (and s) written above are visible to every thread of the program
    acc = tl.load(sum_rows, mask=row_ok, other=0.0)
    for b in tl.static_range(1, NB):  # blocks left to right
        acc = acc + tl.load(sum_rows + b, mask=row_ok, other=0.0)
    mean = tl.div_rn(acc, tl.full((BLOCK_T,), D, tl.float32))
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))[:, None, None]
    for b0 in tl.static_range(0, NB, CHUNK):
        c = b0 * 64 + cols
        mask = row_ok[:, None, None] & (c < D)[None, :, :]
        if HAS_RESIDUAL:
            x = tl.load(s_ptr + dense_rows[:, None, None] + c[None, :, :], mask=mask, other=0.0)
        else:
            x = tl.load(x_rows[:, None, None] + c[None, :, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)[None, :, :]
        if TWO_WEIGHTS:
            second = ((rows % H) >= W2_FROM)[:, None, None]
            w = tl.where(second, tl.load(w2_ptr + c, mask=c < D, other=0.0).to(tl.float32)[None, :, :], w)
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
        y = (normed.to(tl.float32) * w).to(x.dtype)
        tl.store(y_ptr + dense_rows[:, None, None] + c[None, :, :], y, mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x as a [T, H, D] view or copy with a unit last stride, H, stride of t, stride of h): a [T, H, D]
    slice of a wider tensor (vLLM's q and k out of the fused QKV) is read in place."""
    d = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, 1, x2.stride(0), 0


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight2: torch.Tensor | None = None,
    w2_from: int | None = None,
):
    d = x.shape[-1]
    xv, heads, stride_t, stride_h = _rows(x)
    rows = x.numel() // d if d else 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else y
    if rows:
        nb = triton.cdiv(d, 64)
        chunk = min(CHUNK_BLOCKS, triton.next_power_of_2(nb))
        block_t = max(1, TILE // (chunk * 64))
        sums = torch.empty(rows * nb, dtype=torch.float32, device=x.device)
        res = residual.contiguous() if residual is not None else y
        w = weight.contiguous()
        w2, first2 = (None, 0) if weight2 is None else (weight2.contiguous(), w2_from)
        _rms_norm_kernel[(triton.cdiv(rows, block_t),)](
            xv, res, w, w2, y, s, sums, rows, heads, first2, stride_t, stride_h, eps,
            D=d, NB=nb, CHUNK=chunk, BLOCK_T=block_t, HAS_RESIDUAL=residual is not None, TWO_WEIGHTS=w2 is not None,
            num_warps=4, **LAUNCH,
        )  # fmt: skip
    return y, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] under the contract; returns x's shape and dtype."""
    return _launch(x, None, weight, eps)[0]


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, first2: int, eps: float):
    """RMSNorm of every head of x [T, H, D] (a strided view read in place), heads h >= first2 scaled by weight2,
    the others by weight: Qwen3's q and k norms over the q and k heads of the fused QKV in one launch."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_heads takes x [T, H, D] with a unit last stride, got {list(x.shape)}")
    return _launch(x, None, weight, eps, weight2, first2)[0]


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to x's dtype, in one launch (x, residual [..., D])."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"rms_norm: residual {list(residual.shape)} {residual.dtype} must match x {list(x.shape)} {x.dtype}"
        )
    return _launch(x, residual, weight, eps)


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
