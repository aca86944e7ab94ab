"""Strict mixture-of-experts kernels on Triton: the router, the grouped expert GEMM and the combine.

Router (the torch contract's operations, one program per block of tokens): m = max of the fp32 logits, e =
exp64(l - m) rounded to fp32, s = the pairwise tree over the E lanes (padded lanes 0; by `tree_sum_lanes`, a
butterfly with the tree's bits), p = div_rn(e, s); k passes each pick the highest p not yet picked, the lowest
id among equals; the picked lanes are written in ascending id (their place is the running count of picked
lanes); renormalised weights divide by the tree over the E lanes with the lanes not picked zero.

Grouped GEMM: rows sorted by expert; every expert's rows are cut into row tiles of BLOCK_M that never cross
its end. The tile table is built on the device from the per-expert row counts (no host sync, so a CUDA graph
captures the MoE forward) and the grid is the worst case, (rows + E * (BLOCK_M - 1)) // BLOCK_M tiles; programs
past the real tile count return at once. A program computes one (tile, column block) as the GEMM contract's
one-group linear does: one fp32 accumulator from zero, k16 tensor-core steps in ascending K (`gemm._group_dot`,
no split-K). A row's bits therefore depend on its own inputs and its expert's weights only, at every group size
and position (the same bits as `gemm.linear(row, weight[e])` on the Triton server).

Combine: per token, acc = w0 * y0, acc = acc + wj * yj in ascending expert id, rounded once (fp fusion off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton import activation
from rl_kernel.backends.triton.gemm import _group_dot, _operands
from rl_kernel.backends.triton.numerics import LAUNCH, exp64, tree_sum_lanes

ROUTER_ROWS = 16  # tokens per router program (no bit depends on it)
TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}  # moves no bit
COMBINE_BLOCK = 1024


@triton.jit(do_not_specialize=["rows"])
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    rows,
    E,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    LOG2_E: tl.constexpr,
):
    BLOCK_E: tl.constexpr = 1 << LOG2_E
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    lane = tl.arange(0, BLOCK_E)
    ok = (r[:, None] < rows) & (lane[None, :] < E)
    lg = tl.load(logits_ptr + r[:, None] * E + lane[None, :], mask=ok, other=float("-inf"))
    m = tl.max(lg, axis=1)
    z = lg - m[:, None]
    e = tl.where(ok, exp64(z.to(tl.float64)).to(tl.float32), 0.0)
    p = tl.div_rn(e, tree_sum_lanes(e, LOG2_E)[:, None])
    p = tl.where(lane[None, :] < E, p, -1.0)  # padded lanes are never picked
    picked = lane[None, :] < 0
    for _ in tl.static_range(K):
        best = tl.max(tl.where(picked, -2.0, p), axis=1)
        first = tl.min(tl.where((p == best[:, None]) & ~picked, lane[None, :], BLOCK_E), axis=1)
        picked = picked | (lane[None, :] == first[:, None])
    w = tl.where(picked, p, 0.0)
    if RENORMALIZE:
        w = tl.div_rn(w, tree_sum_lanes(w, LOG2_E)[:, None])
    slot = tl.cumsum(picked.to(tl.int32), axis=1) - 1
    out = r[:, None] * K + slot
    store = picked & (r[:, None] < rows)
    tl.store(ids_ptr + out, lane[None, :].to(tl.int64) + tl.zeros_like(out), mask=store)
    tl.store(weights_ptr + out, w, mask=store)


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, k], int64 ids [T, k] ascending) of fp32 router logits [T, E] under the contract."""
    logits = logits.to(torch.float32).contiguous()
    rows, experts = logits.shape
    weights = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    if rows:
        _route_kernel[(triton.cdiv(rows, ROUTER_ROWS),)](
            logits,
            weights,
            ids,
            rows,
            experts,
            K=k,
            RENORMALIZE=renormalize,
            ROWS=ROUTER_ROWS,
            LOG2_E=max(experts - 1, 0).bit_length(),
            num_warps=4,
            **LAUNCH,
        )
    return weights, ids


@triton.jit(do_not_specialize=["N"])
def _grouped_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:  # past the real tiles of the worst-case grid
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _group_dot(
        x_ptr,
        w_ptr + expert * stride_we,
        offs_m,
        offs_n,
        end,
        N,
        stride_xm,
        stride_wn,
        0,
        K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
    )
    mask = (offs_m[:, None] < end) & (offs_n[None, :] < N)
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _host_tiles(counts: list[int], block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end row) of every row tile, built on the host (the reference for `_device_tiles`):
    each expert's rows cut into tiles of `block_m` rows."""
    experts, starts, ends, start = [], [], [], 0
    for e, n in enumerate(counts):
        for s in range(start, start + n, block_m):
            experts.append(e)
            starts.append(s)
            ends.append(start + n)
        start += n
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (experts, starts, ends))


def max_tiles(rows: int, experts: int, block_m: int) -> int:
    """The most row tiles `rows` rows over `experts` experts can need: sum_e ceil(n_e / block_m)."""
    return (rows + experts * (block_m - 1)) // block_m


def _device_tiles(counts: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """`_host_tiles`' table from int64 counts [E] on their device, padded to `max_tiles` with expert -1 (start
    and end 0): fixed shapes, no host sync."""
    counts = counts.to(torch.int64)
    experts = counts.numel()
    ends = torch.cumsum(counts, 0)
    per = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(per, 0)
    t = torch.arange(max_tiles(rows, experts, block_m), device=counts.device)
    e = torch.searchsorted(tile_end, t, right=True)  # the expert of tile t; E past the last tile
    valid = e < experts
    ec = e.clamp(max=experts - 1)
    start = ends[ec] - counts[ec] + (t - (tile_end[ec] - per[ec])) * block_m
    zero = torch.zeros_like(t)
    return tuple(
        torch.where(valid, v, fill).to(torch.int32) for v, fill in ((ec, zero - 1), (start, zero), (ends[ec], zero))
    )


def _counts_tensor(counts: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    if isinstance(counts, torch.Tensor):
        return counts.to(device=device, dtype=torch.int64)
    return torch.tensor(counts, dtype=torch.int64, device=device)


def grouped_linear(
    x: torch.Tensor,
    counts: torch.Tensor | list[int],
    weight: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    tile: dict | None = None,
    host_tiles: bool = False,
    tiles: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """[R, N] in `out_dtype`: rows of expert e (x sorted by expert, `counts` [E] rows each, a device tensor or
    a list) times weight[e] [N, K].T, one fp32 K chain per element rounded once. No host sync: the tile table
    is built on the device (or passed in `tiles`, `row_tiles`' table for these counts and tile). `tile` and
    `host_tiles` (the table built on the host, a list `counts`: the old path) are for tests: no bit depends
    on them."""
    x, weight, precision = _operands(x, weight)
    rows, n, k = x.shape[0], weight.shape[1], weight.shape[2]
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    cfg = dict(tile or TILE)
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if rows == 0 or n == 0:
        return out
    if tiles is None:
        tiles = row_tiles(counts, rows, x.device, tile, host_tiles)
    experts, starts, ends = tiles
    if experts.numel() == 0:
        return out
    _grouped_kernel[(experts.numel(), triton.cdiv(n, bn))](
        x,
        weight,
        out,
        experts,
        starts,
        ends,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PRECISION=precision,
        **cfg,
        **LAUNCH,
    )
    return out


def row_tiles(
    counts: torch.Tensor | list[int],
    rows: int,
    device: torch.device,
    tile: dict | None = None,
    host_tiles: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end row) int32 of every row tile of `grouped_linear` for `counts`: built on the
    device (padded to `max_tiles`), or on the host from a list when `host_tiles`."""
    bm = (tile or TILE)["BLOCK_M"]
    if host_tiles:
        return _host_tiles(list(counts), bm, device)
    return _device_tiles(_counts_tensor(counts, device), rows, bm)


def grouped_mlp(
    x: torch.Tensor,
    counts: torch.Tensor | list[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    tile: dict | None = None,
    host_tiles: bool = False,
) -> torch.Tensor:
    """fp32 [R, D]: each expert's SwiGLU MLP on its rows (`counts` [E] per expert, a device tensor: no host
    sync), gate/up rounded to x's dtype, down unrounded. Both GEMMs share one tile table."""
    tiles = row_tiles(counts, x.shape[0], x.device, tile, host_tiles) if x.shape[0] else None
    h = grouped_linear(x, counts, gate_up, x.dtype, tile=tile, tiles=tiles)
    return grouped_linear(activation.silu_and_mul(h), counts, down, torch.float32, tile=tile, tiles=tiles)


@triton.jit(do_not_specialize=["D"])
def _combine_kernel(y_ptr, w_ptr, out_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.load(y_ptr + t * K * D + cols, mask=mask, other=0.0) * tl.load(w_ptr + t * K)
    for j in tl.static_range(1, K):
        acc = acc + tl.load(y_ptr + (t * K + j) * D + cols, mask=mask, other=0.0) * tl.load(w_ptr + t * K + j)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, D] in `out_dtype`: sum_j weights[:, j] * y[:, j] in fp32, j ascending, rounded once."""
    y, weights = y.to(torch.float32).contiguous(), weights.to(torch.float32).contiguous()
    t, k, d = y.shape
    out = torch.empty(t, d, dtype=out_dtype, device=y.device)
    if t and d:
        _combine_kernel[(t, triton.cdiv(d, COMBINE_BLOCK))](
            y, weights, out, d, K=k, BLOCK=COMBINE_BLOCK, num_warps=4, **LAUNCH
        )
    return out
