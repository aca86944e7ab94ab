"""Strict mixture-of-experts kernels on Triton: the router, the grouped expert GEMM and the combine.

Router (the torch contract's operations, one program per block of tokens): m = max of the fp32 logits, e =
exp64(l - m) rounded to fp32, s = the pairwise tree over the E lanes (padded lanes 0; by `tree_sum_lanes`, a
butterfly with the tree's bits), p = div_rn(e, s); k passes each pick the highest p not yet picked, the lowest
id among equals; the picked lanes are written in ascending id (their place is the running count of picked
lanes); renormalised weights divide by the tree over the E lanes with the lanes not picked zero.

Dispatch (the counting sort of the (token, slot) rows by expert: integers, no bit contract): per block of rows
each expert's count and each row's rank among its block's rows of that expert, then per row its place = the rows
of the lower experts + its expert's rows in the blocks before + its rank. Two launches, no host read.

Grouped GEMM: rows sorted by expert; every expert's rows are cut into row tiles of BLOCK_M that never cross
its end. Each program finds its tile's expert and rows from the per-expert row counts (a scan of E lanes; no
host sync and no tile table, so a CUDA graph captures the MoE forward) on a grid of the worst case,
(rows + E * (BLOCK_M - 1)) // BLOCK_M tiles; programs past the real tile count return at once. The gate/up
GEMM reads its rows from the tokens through the sorted order (no gathered copy). A program computes one
(tile, column block) as the GEMM contract's one-group linear does: one fp32 accumulator from zero, k16
tensor-core steps in ascending K (`_expert_dot`: `gemm._group_dot`'s chain, no split-K; the expert weights, and
the rows where they are x's own, read by TMA descriptors, which hold no pointer tensors: on an H100 the prefill
chunk's expert MLP ran 3.7% faster than by pointer loads, the decode batch's the same). A row's bits therefore
depend on its own inputs and its expert's weights only, at every group size and position (the same bits as
`gemm.linear(row, weight[e])` on the Triton server).

Combine: per token, acc = w0 * y0, acc = acc + wj * yj in ascending expert id, rounded once (fp fusion off); the
slots read where the grouped GEMM left them (no gathered copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rl_kernel.backends.triton import activation
from rl_kernel.backends.triton.gemm import _operands
from rl_kernel.backends.triton.numerics import LAUNCH, exp64, tree_sum_lanes
from rl_kernel.errors import StrictModeError

ROUTER_ROWS = 16  # tokens per router program (no bit depends on it)
# Tiles move no bit (every one is the same k16 chain from one fp32 zero); benchmarks/moe_grouped_gemm.py picked
# them at Qwen3-30B-A3B shapes: the small tile where an expert has a few rows (decode), the large one where its
# rows fill 128-row tiles (a prefill chunk: 1.6x faster there).
TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
PREFILL_TILE = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
PREFILL_ROWS_PER_EXPERT = 128
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


@triton.jit(do_not_specialize=["N", "x_rows"])
def _grouped_kernel(
    x_ptr,
    x_desc,
    w_desc,
    out_ptr,
    counts_ptr,
    source_ptr,
    x_rows,
    N,
    K,
    E,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SLOTS: tl.constexpr,
    GATHER: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    # this tile's expert and rows, from the counts: expert e's rows [row_end[e] - counts[e], row_end[e]) are cut
    # into tiles of BLOCK_M; the tiles of the experts before e come first
    lane = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + lane, mask=lane < E, other=0).to(tl.int32)
    per = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(per, axis=0)
    expert = tl.sum((tile_end <= tile).to(tl.int32), axis=0)
    if expert >= E:  # past the real tiles of the worst-case grid
        return
    row_end = tl.cumsum(counts, axis=0)
    mine = lane == expert
    end = tl.sum(tl.where(mine, row_end, 0), axis=0)
    start = tl.sum(tl.where(mine, row_end - counts + (tile - tile_end + per) * BLOCK_M, 0), axis=0)
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATHER:  # row i is token source[i] // SLOTS of x; rows past the tile's end load zeros, as below
        src = tl.load(source_ptr + offs_m, mask=offs_m < end, other=0) // SLOTS
        x_offs = tl.where(offs_m < end, src, x_rows)
        x_limit = x_rows
    else:
        x_offs = offs_m
        x_limit = end
    n0 = tl.program_id(1) * BLOCK_N
    acc = _expert_dot(
        x_ptr, x_desc, w_desc, expert, x_offs, start, n0, x_limit, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
        not GATHER,
    )  # fmt: skip
    mask = (offs_m[:, None] < end) & (offs_n[None, :] < N)
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _expert_dot(
    x_ptr,
    x_desc,
    w_desc,
    expert,
    offs_m,
    m0,
    n0,
    M,
    stride_xm,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    X_TMA: tl.constexpr,
):
    """`gemm._group_dot` over the whole K of rows offs_m of x and weight rows [n0, n0 + BLOCK_N) of expert
    `expert` (the same dots from zero, left to right: the same bits), the weights by their TMA descriptor
    [E, N, K] (no pointer tensor: fewer live registers; rows past N read zeros and only feed columns never
    stored). X_TMA: the rows [m0, m0 + BLOCK_M) of x by its descriptor too (rows past the tile's own only feed
    rows never stored); else rows offs_m (< M) by pointers."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m[:, None] < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        if X_TMA:
            a = x_desc.load([m0, k0])
        else:
            a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok & ((k0 + offs_k) < K)[None, :], other=0.0)
        b = tl.reshape(w_desc.load([expert, n0, k0]), (BLOCK_N, BLOCK_K))
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


def max_tiles(rows: int, experts: int, block_m: int) -> int:
    """The most row tiles `rows` rows over `experts` experts can need: sum_e ceil(n_e / block_m)."""
    return (rows + experts * (block_m - 1)) // block_m


def tile_for(rows: int, experts: int) -> dict:
    """The launch tile for `rows` sorted rows over `experts` experts (host integers only: no sync)."""
    return PREFILL_TILE if rows >= PREFILL_ROWS_PER_EXPERT * experts else TILE


def _counts_tensor(counts: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    if isinstance(counts, torch.Tensor):
        return counts.to(device=device, dtype=torch.int64).contiguous()
    return torch.tensor(counts, dtype=torch.int64, device=device)


def grouped_linear(
    x: torch.Tensor,
    counts: torch.Tensor | list[int],
    weight: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    source: torch.Tensor | None = None,
    slots: int = 1,
    tile: dict | None = None,
) -> torch.Tensor:
    """[R, N] in `out_dtype`: the rows of expert e (sorted by expert, `counts` [E] rows each, a device tensor or
    a list) times weight[e] [N, K].T, one fp32 K chain per element rounded once. The rows are x's own, or with
    `source` (int64 [R]) row i is x[source[i] // slots] (tokens x [T, K], read in place: no gathered copy).
    No host sync: every program finds its expert and rows from the counts, on a grid of the most tiles R rows
    can need. `tile` overrides `tile_for` (for tests and benchmarks): no bit depends on it. The weights are read
    by TMA descriptors (and x, where its rows are its own): x and weight need 16-byte aligned bases and rows."""
    x, weight, precision = _operands(x, weight)
    rows = x.shape[0] if source is None else source.numel()
    n, k, experts = weight.shape[1], weight.shape[2], weight.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    cfg = dict(tile or tile_for(rows, experts))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if rows == 0 or n == 0:
        return out
    for name, t in (("x", x), ("weight", weight)):
        if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            raise StrictModeError(
                "moe",
                "triton",
                f"the grouped expert GEMM reads {name} {list(t.shape)} by TMA, which needs 16-byte aligned rows and "
                "base; pad the expert widths to a multiple of 8 (bf16) or run moe on the torch backend",
            )
    counts = _counts_tensor(counts, x.device)
    gather = source is not None
    _grouped_kernel[(max_tiles(rows, experts, bm), triton.cdiv(n, bn))](
        x,
        TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk]),
        TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [1, bn, bk]),
        out,
        counts,
        source.contiguous() if gather else counts,
        x.shape[0],
        n,
        k,
        experts,
        x.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        BLOCK_E=triton.next_power_of_2(experts),
        SLOTS=slots,
        GATHER=gather,
        PRECISION=precision,
        **cfg,
        **LAUNCH,
    )
    return out


def grouped_mlp(
    x: torch.Tensor,
    counts: torch.Tensor | list[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    source: torch.Tensor | None = None,
    slots: int = 1,
    tile: dict | None = None,
) -> torch.Tensor:
    """fp32 [R, D]: each expert's SwiGLU MLP on its rows (`counts` [E] per expert, a device tensor: no host
    sync; rows as `grouped_linear` reads them from x and `source`), gate/up rounded to x's dtype, down
    unrounded."""
    h = grouped_linear(x, counts, gate_up, x.dtype, source=source, slots=slots, tile=tile)
    return grouped_linear(activation.silu_and_mul(h), counts, down, torch.float32, tile=tile)


@triton.jit
def _slot_row(place_ptr, t, j, K: tl.constexpr, PLACED: tl.constexpr):
    if PLACED:
        return tl.load(place_ptr + t * K + j).to(tl.int64)
    return t * K + j


@triton.jit(do_not_specialize=["D"])
def _combine_kernel(y_ptr, w_ptr, place_ptr, out_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr, PLACED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = _slot_row(place_ptr, t, 0, K, PLACED)
    acc = tl.load(y_ptr + row * D + cols, mask=mask, other=0.0) * tl.load(w_ptr + t * K)
    for j in tl.static_range(1, K):
        row = _slot_row(place_ptr, t, j, K, PLACED)
        acc = acc + tl.load(y_ptr + row * D + cols, mask=mask, other=0.0) * tl.load(w_ptr + t * K + j)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(
    y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype, place: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, D] in `out_dtype`: sum_j weights[:, j] * y[:, j] in fp32, j ascending, rounded once. y fp32
    [T, k, D]; or with `place` (int64 [T * k]), y [T * k, D] holds slot (t, j) at row place[t * k + j] (read in
    place: no gathered copy)."""
    y, weights = y.to(torch.float32).contiguous(), weights.to(torch.float32).contiguous()
    t, k = weights.shape
    d = y.shape[-1]
    out = torch.empty(t, d, dtype=out_dtype, device=y.device)
    if t and d:
        placed = place is not None
        _combine_kernel[(t, triton.cdiv(d, COMBINE_BLOCK))](
            y,
            weights,
            place.contiguous() if placed else weights,
            out,
            d,
            K=k,
            BLOCK=COMBINE_BLOCK,
            PLACED=placed,
            num_warps=4,
            **LAUNCH,
        )
    return out


# ---- dispatch: the counting sort of (token, slot) rows by expert, in two kernels -------------------------


@triton.jit(do_not_specialize=["rows"])
def _dispatch_count_kernel(ids_ptr, rank_ptr, block_counts_ptr, rows, E, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per block of BLOCK_R rows: each row's rank among the block's rows of its expert, and the block's count of
    each expert's rows (block_counts[block, e])."""
    block = tl.program_id(0)
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    ids = tl.load(ids_ptr + r, mask=r < rows, other=-1).to(tl.int32)
    lane = tl.arange(0, BLOCK_E)
    hot = (ids[:, None] == lane[None, :]).to(tl.int32)
    rank = tl.sum(hot * tl.cumsum(hot, axis=0), axis=1) - 1
    tl.store(rank_ptr + r, rank, mask=r < rows)
    tl.store(block_counts_ptr + block * E + lane, tl.sum(hot, axis=0), mask=lane < E)


@triton.jit(do_not_specialize=["rows", "blocks"])
def _dispatch_place_kernel(
    ids_ptr,
    rank_ptr,
    block_counts_ptr,
    order_ptr,
    place_ptr,
    counts_ptr,
    rows,
    blocks,
    E,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Per block: a row's place = its expert's first row (the rows of the lower experts) + the expert's rows in
    the blocks before + the row's rank in its block; order[place] = row. Block 0 writes the counts."""
    block = tl.program_id(0)
    lane = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), tl.int32)
    before = tl.zeros((BLOCK_E,), tl.int32)
    for b0 in range(0, blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        c = tl.load(
            block_counts_ptr + b[:, None] * E + lane[None, :], mask=(b[:, None] < blocks) & (lane[None, :] < E), other=0
        )
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where(b[:, None] < block, c, 0), axis=0)
    first = tl.cumsum(total, axis=0) - total + before
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    ids = tl.load(ids_ptr + r, mask=ok, other=-1).to(tl.int32)
    place = tl.sum(tl.where(ids[:, None] == lane[None, :], first[None, :], 0), axis=1) + tl.load(
        rank_ptr + r, mask=ok, other=0
    )
    tl.store(place_ptr + r, place.to(tl.int64), mask=ok)
    tl.store(order_ptr + place, r.to(tl.int64), mask=ok)
    if block == 0:
        tl.store(counts_ptr + lane, total.to(tl.int64), mask=lane < E)


def dispatch(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, place, counts) of int64 expert ids [R] in [0, experts): `rl_kernel.ops.moe.expert_order`'s
    integers (the stable sort of the rows by expert, its inverse, each expert's rows) in two launches and no host
    read: per block of rows its experts' counts and each row's rank among them; then each row's place from the
    counts of the blocks before it."""
    rows = flat_ids.numel()
    dev = flat_ids.device
    order = torch.empty(rows, dtype=torch.int64, device=dev)
    place = torch.empty(rows, dtype=torch.int64, device=dev)
    counts = torch.zeros(experts, dtype=torch.int64, device=dev)
    if rows == 0:
        return order, place, counts
    block_e = triton.next_power_of_2(experts)
    block_r = max(16, min(128, 16384 // block_e))
    blocks = triton.cdiv(rows, block_r)
    rank = torch.empty(rows, dtype=torch.int32, device=dev)
    block_counts = torch.empty(blocks, experts, dtype=torch.int32, device=dev)
    ids = flat_ids.contiguous()
    _dispatch_count_kernel[(blocks,)](
        ids, rank, block_counts, rows, experts, BLOCK_R=block_r, BLOCK_E=block_e, num_warps=4, **LAUNCH
    )
    _dispatch_place_kernel[(blocks,)](
        ids,
        rank,
        block_counts,
        order,
        place,
        counts,
        rows,
        blocks,
        experts,
        BLOCK_R=block_r,
        BLOCK_E=block_e,
        BLOCK_B=max(1, 4096 // block_e),
        num_warps=4,
        **LAUNCH,
    )
    return order, place, counts
