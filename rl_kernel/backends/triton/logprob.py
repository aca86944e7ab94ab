"""Strict fused linear-logprob on the GPU: hidden x LM head -> selected-token fp32 logprob, without
ever holding [T, V] logits.

Contract (triton v2). Logits are fp32 one-chain products of the GEMM contract (`gemm.py`: one fp32
accumulator over D, k16 tensor-core steps in ascending order), under a bf16 logit dtype
(`rl_kernel.set_logits_dtype`) rounded once to bf16, as native F.linear returns them (cuBLASLt's bf16
epilogue; the fused kernel rounds in registers). z = logits / fp32(temperature) (IEEE
div); columns past the real vocab are -inf. The vocab is cut into fixed tiles of VOCAB_TILE = 64
columns counted from column 0 of the full vocab. Per (row, tile): m_j = max z (exact) and S_j = sum
of rint(exp2((z - m_j) log2 e) 2^40) in int64 (exp2 = hardware ex2.approx.f32). Per row: M = max_j
m_j (exact), total = sum_j rint(S_j * exp2((m_j - M) log2 e)) in int64 (fp64 product), lse = M +
log(total 2^-40) in fp64 (rl_kernel's log64), logprob = z[target] - lse rounded once to fp32. Every
sum is an integer sum, so rows, tiles, kernel schedules and vocab sharding (slices of whole tiles,
any rank order) give the same bits.

Two servers of the forward, the same bits: with cuBLASLt ready, fp32 logits of one vocab slice at a
time come from cuBLASLt (no split-K) and `_stats_kernel` reduces them; otherwise `_fused_kernel`
computes each logits tile with the Triton GEMM and reduces it in registers. Either way the forward's
state (a row chunk's per-tile stats, plus one logits slice) stays under 1/STATE_FRACTION of the LM
head's bytes.

Backward (no bit contract): per vocab slice, the logits are recomputed by a tensor-core GEMM, the
logit gradient (onehot - p) * g / T is formed in bf16 by `_dlogits_kernel`, and two more tensor-core
GEMMs give that slice's LM-head gradient and add its share of the hidden gradient (fp32).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from rl_kernel.backends.torch.logprob import exact_all_reduce
from rl_kernel.backends.triton import gemm
from rl_kernel.backends.triton.gemm import _group_dot, _tile_ids
from rl_kernel.backends.triton.numerics import LAUNCH, f64, log64
from rl_kernel.errors import StrictModeError

VOCAB_TILE = 64
FIXED_POINT_BITS = 40
LOG2E = 1.4426950408889634
STATE_FRACTION = 12  # the forward's per-tile stats and logits slice stay under 1/12 of the LM head's bytes
# The forward's budget is split evenly between a row chunk's tile stats and one logits slice. Few, wide slices:
# each costs a cuBLASLt call and a Triton launch on the host (about 0.1 ms on an H200 host), so slices sized
# for L2 (2048 x 2048) left the GPU waiting: 34 ms against 18 (benchmarks/results/logprob_probe_h200.txt).
FORWARD_PARTS = 2
MIN_STATE_BYTES = 1 << 25
STATS_TILE = {"BLOCK_M": 16, "BLOCK_N": 256, "num_warps": 4}
KEPT_SLICE_FACTOR = 4
ROW_ALIGN = 128  # row chunks are whole multiples of the GEMM's row tiles where the budget allows
# How the stats pass computes the contract's numbers (none moves a bit; tests/gpu compare each off): skip the
# division at temperature 1, round to int64 in one cvt.rni, read the target's logit instead of summing it out.
# H200: the stats pass over 8192 x 151936 logits takes 1.73 ms of GPU time, 2.64 with all three off
# (CUDA-graph replays, benchmarks/results/logprob_probe_h200.txt).
STATS_OPTIONS = {"FAST_TEMP": True, "RNI": True, "TARGET_LOAD": True}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs no inline PTX


@triton.jit
def _rint32(y):
    """Round-to-nearest-even of fp32 y >= 0 to an integer-valued fp32 (exact: adds of 2^23)."""
    return tl.where(y < 8388608.0, (y + 8388608.0) - 8388608.0, y)


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32: cuBLASLt's bf16 epilogue. In integer arithmetic
    on the bits, which Triton's interpreter runs as the GPU does (its bf16 casts truncate)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(logits, temp, temp_b, FAST_TEMP: tl.constexpr):
    """z = logits / temperature per row (IEEE div); temp: the block's per-row temperatures, temp_b: the same
    broadcastable against logits. A block whose rows all run at temperature 1 skips the division: x / 1 == x."""
    z = logits
    if FAST_TEMP:
        if (tl.min(temp, 0) != 1.0) | (tl.max(temp, 0) != 1.0):
            z = tl.div_rn(logits, temp_b)
    else:
        z = tl.div_rn(logits, temp_b)
    return z


@triton.jit
def _fixed_point(e, FIXED: tl.constexpr, RNI: tl.constexpr):
    """rint(e * FIXED) as int64, round half to even. RNI: one cvt.rni instruction (the same rounding)."""
    if RNI:
        q = tl.inline_asm_elementwise(
            "cvt.rni.s64.f32 $0, $1;", "=l,r", [e * FIXED], dtype=tl.int64, is_pure=True, pack=1
        )
    else:
        q = _rint32(e * FIXED).to(tl.int64)
    return q


@triton.jit
def _tile_sums(
    zz,
    offs_m,
    first,
    row_ok,
    m_ptr,
    s_ptr,
    n_tiles,
    BLOCK_N: tl.constexpr,
    VT: tl.constexpr,
    FIXED: tl.constexpr,
    LOG2E: tl.constexpr,
    RNI: tl.constexpr,
    ew_ptr,
    ENTROPY: tl.constexpr,
):
    """Per (row, vocab tile of VT columns) of a z block [BLOCK_M, BLOCK_N // VT, VT] whose first column is
    `first`: exact max and int64 fixed-point sum of exp; with ENTROPY also W = the int64 fixed-point sum of
    e (m - z) (the entropy's spread term, each <= 1/e)."""
    m = tl.max(zz, 2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    e = tl.math.exp2((zz - m_use[:, :, None]) * LOG2E)
    s = tl.sum(_fixed_point(e, FIXED, RNI), 2)
    tiles = first // VT + tl.arange(0, BLOCK_N // VT)
    idx = offs_m.to(tl.int64)[:, None] * n_tiles + tiles[None, :]
    mask = row_ok[:, None] & (tiles < n_tiles)[None, :]
    tl.store(m_ptr + idx, m, mask=mask)
    tl.store(s_ptr + idx, s, mask=mask)
    if ENTROPY:
        spread = tl.where(e > 0.0, e * (m_use[:, :, None] - zz), 0.0)
        tl.store(ew_ptr + idx, tl.sum(_fixed_point(spread, FIXED, RNI), 2), mask=mask)


@triton.jit
def _tile_stats(
    logits,
    offs_m,
    offs_n,
    row_ok,
    temp_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    zt_ptr,
    V,
    vocab_start,
    vocab_size,
    n_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VT: tl.constexpr,
    FIXED: tl.constexpr,
    LOG2E: tl.constexpr,
    FAST_TEMP: tl.constexpr,
    RNI: tl.constexpr,
    ew_ptr,
    ENTROPY: tl.constexpr,
):
    """`_tile_sums` of an fp32 logits block held in registers, and the target's z for the rows whose target
    column lies in it (summed out of the block: z + 0 + ... + 0)."""
    temp = tl.load(temp_ptr + offs_m, mask=row_ok, other=1.0)
    z = _scaled(logits, temp, temp[:, None], FAST_TEMP)
    real = (offs_n < V) & (vocab_start + offs_n < vocab_size)
    z = tl.where(real[None, :], z, float("-inf"))
    local = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1) - vocab_start
    hit = (offs_n[None, :] == local[:, None]) & real[None, :]
    z_t = tl.sum(tl.where(hit, z, 0.0), 1)
    first = tl.min(offs_n, 0)
    owns = row_ok & (local >= first) & (local < first + BLOCK_N) & (local < V)
    tl.store(zt_ptr + offs_m, z_t, mask=owns)
    _tile_sums(
        tl.reshape(z, (BLOCK_M, BLOCK_N // VT, VT)),
        offs_m,
        first,
        row_ok,
        m_ptr,
        s_ptr,
        n_tiles,
        BLOCK_N,
        VT,
        FIXED,
        LOG2E,
        RNI,
        ew_ptr,
        ENTROPY,
    )


@triton.jit
def _fused_kernel(
    h_ptr,
    w_ptr,
    temp_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    zt_ptr,
    T,
    V,
    stride_h,
    stride_w,
    K,
    vocab_start,
    vocab_size,
    n_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    VT: tl.constexpr,
    FIXED: tl.constexpr,
    LOG2E: tl.constexpr,
    FAST_TEMP: tl.constexpr,
    RNI: tl.constexpr,
    BF16_LOGITS: tl.constexpr,
    ew_ptr=None,
    ENTROPY: tl.constexpr = False,
):
    pid_m, pid_n = _tile_ids(T, V, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    logits = _group_dot(
        h_ptr, w_ptr, offs_m, offs_n, T, V, stride_h, stride_w, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION
    )
    if BF16_LOGITS:
        logits = _round_bf16(logits)
    _tile_stats(
        logits,
        offs_m,
        offs_n,
        offs_m < T,
        temp_ptr,
        tgt_ptr,
        m_ptr,
        s_ptr,
        zt_ptr,
        V,
        vocab_start,
        vocab_size,
        n_tiles,
        BLOCK_M,
        BLOCK_N,
        VT,
        FIXED,
        LOG2E,
        FAST_TEMP,
        RNI,
        ew_ptr,
        ENTROPY,
    )


@triton.jit(do_not_specialize=["T"])  # one compile for every row count
def _stats_kernel(
    logits_ptr,
    temp_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    zt_ptr,
    T,
    V,
    col0,
    cols,
    stride_l,
    vocab_start,
    vocab_size,
    n_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VT: tl.constexpr,
    FIXED: tl.constexpr,
    LOG2E: tl.constexpr,
    FAST_TEMP: tl.constexpr,
    RNI: tl.constexpr,
    TARGET_LOAD: tl.constexpr,
    ew_ptr=None,
    ENTROPY: tl.constexpr = False,
):
    """The per-tile stats of a precomputed logits slice [T, cols] (fp32, or bf16 under a bf16 logit contract)
    holding local vocab columns col0..
    TARGET_LOAD: the block is loaded as [rows, tiles, VT] (no reshape of a 2-D block), and the target's z is
    read from the slice (one load per row) instead of summed out of the block; + 0.0 gives the sum's +0 for a
    -0 logit."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T
    rows = offs_m.to(tl.int64) * stride_l
    first = tl.program_id(1) * BLOCK_N
    if TARGET_LOAD:
        offs_c = first + tl.arange(0, BLOCK_N // VT)[:, None] * VT + tl.arange(0, VT)[None, :]
        logits = tl.load(
            logits_ptr + rows[:, None, None] + offs_c[None, :, :],
            mask=row_ok[:, None, None] & (offs_c < cols)[None, :, :],
            other=0.0,
        ).to(tl.float32)
        temp = tl.load(temp_ptr + offs_m, mask=row_ok, other=1.0)
        offs_n = col0 + offs_c
        real = (offs_n < V) & (vocab_start + offs_n < vocab_size)
        z = tl.where(real[None, :, :], _scaled(logits, temp, temp[:, None, None], FAST_TEMP), float("-inf"))
        local = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1) - vocab_start
        owns = row_ok & (local >= col0 + first) & (local < col0 + first + BLOCK_N) & (local < V)
        hit = owns & (local - col0 < cols) & (vocab_start + local < vocab_size)
        z_t = tl.div_rn(tl.load(logits_ptr + rows + (local - col0), mask=hit, other=0.0).to(tl.float32), temp) + 0.0
        tl.store(zt_ptr + offs_m, z_t, mask=owns)
        _tile_sums(
            z, offs_m, col0 + first, row_ok, m_ptr, s_ptr, n_tiles, BLOCK_N, VT, FIXED, LOG2E, RNI, ew_ptr, ENTROPY
        )
    else:
        offs_c = first + tl.arange(0, BLOCK_N)
        logits = tl.load(
            logits_ptr + rows[:, None] + offs_c[None, :], mask=row_ok[:, None] & (offs_c < cols)[None, :], other=0.0
        ).to(tl.float32)
        _tile_stats(
            logits,
            offs_m,
            col0 + offs_c,
            row_ok,
            temp_ptr,
            tgt_ptr,
            m_ptr,
            s_ptr,
            zt_ptr,
            V,
            vocab_start,
            vocab_size,
            n_tiles,
            BLOCK_M,
            BLOCK_N,
            VT,
            FIXED,
            LOG2E,
            FAST_TEMP,
            RNI,
            ew_ptr,
            ENTROPY,
        )


@triton.jit
def _total_kernel(
    m_ptr,
    s_ptr,
    big_m_ptr,
    total_ptr,
    n_tiles,
    LOG2E: tl.constexpr,
    BLOCK: tl.constexpr,
    ew_ptr=None,
    spread_ptr=None,
    ENTROPY: tl.constexpr = False,
):
    """Per row: total = sum_j rint(S_j exp(m_j - M)) in int64; with ENTROPY also the spread
    A = sum_j rint((W_j + (M - m_j) S_j) exp(m_j - M)) (sum_v e_v (M - z_v) at 2^-FIXED, e_v = exp(z_v - M))."""
    row = tl.program_id(0).to(tl.int64)
    big_m = tl.load(big_m_ptr + row)
    acc = tl.zeros((BLOCK,), tl.int64)
    acc_w = tl.zeros((BLOCK,), tl.int64)
    for j0 in range(0, n_tiles, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < n_tiles
        m = tl.load(m_ptr + row * n_tiles + j, mask=ok, other=float("-inf"))
        s = tl.load(s_ptr + row * n_tiles + j, mask=ok, other=0)
        f = tl.math.exp2((m - big_m) * LOG2E)
        y = s.to(tl.float64) * f.to(tl.float64)
        y = (y + 4503599627370496.0) - 4503599627370496.0  # rint: y < 2^52
        live = ok & (m != float("-inf"))
        acc += tl.where(live, y.to(tl.int64), 0)
        if ENTROPY:
            w = tl.load(ew_ptr + row * n_tiles + j, mask=ok, other=0)
            gap = tl.where(live, big_m - m, 0.0).to(tl.float64)
            yw = (w.to(tl.float64) + gap * s.to(tl.float64)) * f.to(tl.float64)
            yw = (yw + 4503599627370496.0) - 4503599627370496.0
            acc_w += tl.where(live, yw.to(tl.int64), 0)
    tl.store(total_ptr + row, tl.sum(acc, 0))
    if ENTROPY:
        tl.store(spread_ptr + row, tl.sum(acc_w, 0))


@triton.jit
def _dlogits_kernel(
    logits_ptr,
    dl_ptr,
    temp_ptr,
    lse_ptr,
    g_ptr,
    tgt_ptr,
    T,
    cols,
    col0,
    stride_l,
    vocab_start,
    vocab_size,
    LOG2E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ge_ptr=None,
    ent_ptr=None,
    ENTROPY: tl.constexpr = False,
):
    """dL/dlogits = (onehot(target) - exp(z - lse)) * g / T for a logits slice (bf16 out; no bit contract); with
    ENTROPY plus the entropy's -g_H p (log p + H) / T."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_m < T)[:, None] & (offs_c < cols)[None, :]
    row = offs_m.to(tl.int64)[:, None] * stride_l + offs_c[None, :]
    temp = tl.load(temp_ptr + offs_m, mask=offs_m < T, other=1.0)
    lse = tl.load(lse_ptr + offs_m, mask=offs_m < T, other=0.0)
    g = tl.load(g_ptr + offs_m, mask=offs_m < T, other=0.0)
    tgt = tl.load(tgt_ptr + offs_m, mask=offs_m < T, other=-1)
    col = vocab_start + col0 + offs_c
    z = tl.load(logits_ptr + row, mask=ok, other=0.0).to(tl.float32) / temp[:, None]
    p = tl.where((col < vocab_size)[None, :], tl.math.exp2((z - lse[:, None]) * LOG2E), 0.0)
    onehot = tl.where(col[None, :] == tgt[:, None], 1.0, 0.0)
    dl = (onehot - p) * (g / temp)[:, None]
    if ENTROPY:
        ge = tl.load(ge_ptr + offs_m, mask=offs_m < T, other=0.0)
        ent = tl.load(ent_ptr + offs_m, mask=offs_m < T, other=0.0)
        dl -= p * (z - lse[:, None] + ent[:, None]) * (ge / temp)[:, None]
    tl.store(dl_ptr + row, dl.to(dl_ptr.dtype.element_ty), mask=ok)


def _check(vocab_start: int, op: str = "logprobs") -> None:
    if vocab_start % VOCAB_TILE:
        raise StrictModeError(
            op,
            "triton",
            f"this rank's vocab slice starts at {vocab_start}, not a multiple "
            f"of the contract's vocab tile {VOCAB_TILE}: pad the vocab so V/tp % {VOCAB_TILE} == 0",
        )


def _state_budget(weight: torch.Tensor) -> int:
    return max(MIN_STATE_BYTES, weight.numel() * weight.element_size() // STATE_FRACTION)


def _even_parts(total: int, most: int, align: int) -> int:
    """Size of the equal parts that cut `total` into as few as `most` allows, rounded up to a multiple of
    `align` while that stays within `most` (whole GEMM tiles, no part-empty last tile)."""
    most = max(1, most)
    part = triton.cdiv(total, triton.cdiv(total, most))
    aligned = triton.cdiv(part, align) * align
    return aligned if aligned <= most else max(part, most // align * align)


def _slice_cols(rows: int, weight: torch.Tensor, bytes_per_element: int, share: int = 1) -> int:
    """Vocab slice width (a multiple of 256 but the last) whose [rows, width] intermediates fit 1/share of the
    state budget."""
    most = max(256, _state_budget(weight) // share // (max(rows, 1) * bytes_per_element) // 256 * 256)
    return _even_parts(weight.shape[0], most, 256)


def _cublaslt_slices(x, w, cols, stats, keep=None, logits_dtype=torch.float32):
    """Logits of vocab slices [c0, c0 + cols) by cuBLASLt in `logits_dtype` (the fp32 chain, rounded once by the
    epilogue when that is x's dtype), each passed to `stats(logits, c0)`; one slice alive at a time unless `keep`
    (a list) holds them for the backward."""
    with gemm.cublaslt():
        for c0 in range(0, w.shape[0], cols):
            if logits_dtype == x.dtype:
                logits = torch.mm(x, w[c0 : c0 + cols].t())
            else:
                logits = torch.mm(x, w[c0 : c0 + cols].t(), out_dtype=torch.float32).to(logits_dtype)
            stats(logits, c0)
            if keep is not None:
                keep.append((c0, logits))
            del logits  # before the next slice is allocated


def _forward_geometry(
    rows: int, weight: torch.Tensor, n_tiles: int, keep: bool = False, logit_bytes: int = 4
) -> tuple[int, int]:
    """(row chunk, slice columns) of the forward: the row chunk's per-tile stats and one [chunk, columns] logits
    slice (`logit_bytes` per element) each take 1/FORWARD_PARTS of the state budget. `keep` (the slices are held
    for the backward anyway): all rows in one chunk, slices KEPT_SLICE_FACTOR times the budget's width (fewer
    launches)."""
    if keep:
        return rows, KEPT_SLICE_FACTOR * _slice_cols(rows, weight, logit_bytes)
    share = _state_budget(weight) // FORWARD_PARTS
    chunk = _even_parts(rows, max(1, min(rows, share // (n_tiles * 12))), ROW_ALIGN)
    return chunk, _slice_cols(chunk, weight, logit_bytes, share=FORWARD_PARTS)


def _stats_launch() -> dict:
    """The contract's constants and the stats pass's settings (STATS_TILE, STATS_OPTIONS; no inline PTX under the
    interpreter) as the stats kernels take them."""
    options = dict(STATS_OPTIONS, RNI=STATS_OPTIONS["RNI"] and not _INTERPRETED)
    return dict(STATS_TILE, VT=VOCAB_TILE, FIXED=float(1 << FIXED_POINT_BITS), LOG2E=LOG2E, **options, **LAUNCH)


def _tile_stats_of_rows(
    x,
    w,
    temps32,
    tgt,
    m_t,
    s_t,
    z_t,
    vocab_start,
    vocab_size,
    server,
    tile,
    cols,
    keep=None,
    logits_dtype=torch.float32,
    w_t=None,
):
    """Fill per-tile (m, S) and the targets' z for the rows of x under the contract (either server) with logits
    in `logits_dtype` (float32 or bfloat16); the cuBLASLt server's slices are `cols` wide. `keep`, a list,
    receives its logits slices as (first column, logits). `w_t` (int64, as m_t): also each tile's entropy
    spread W."""
    r, v_local = x.shape[0], w.shape[0]
    n_tiles = m_t.shape[1]
    launch = _stats_launch() | {"ew_ptr": w_t, "ENTROPY": w_t is not None}
    if tile is None and gemm.use_cublaslt(x, w, server):
        bm, bn = launch["BLOCK_M"], launch["BLOCK_N"]

        def stats(logits, c0):  # once per slice: kept lean, the host time of a launch is the slice's overhead
            grid = (triton.cdiv(r, bm), triton.cdiv(logits.shape[1], bn))
            _stats_kernel[grid](
                logits,
                temps32,
                tgt,
                m_t,
                s_t,
                z_t,
                r,
                v_local,
                c0,
                logits.shape[1],
                logits.stride(0),
                vocab_start,
                vocab_size,
                n_tiles,
                **launch,
            )

        _cublaslt_slices(x, w, cols, stats, keep, logits_dtype)
        return
    x, w, precision = gemm._operands(x, w)
    cfg = dict(tile or gemm.TILE)
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (triton.cdiv(r, bm) * triton.cdiv(v_local, bn),)
    _fused_kernel[grid](
        x,
        w,
        temps32,
        tgt,
        m_t,
        s_t,
        z_t,
        r,
        v_local,
        x.stride(0),
        w.stride(0),
        x.shape[1],
        vocab_start,
        vocab_size,
        n_tiles,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=gemm.BLOCK_K,
        PRECISION=precision,
        VT=VOCAB_TILE,
        FIXED=launch["FIXED"],
        LOG2E=LOG2E,
        FAST_TEMP=launch["FAST_TEMP"],
        RNI=launch["RNI"],
        BF16_LOGITS=logits_dtype == torch.bfloat16,
        ew_ptr=w_t,
        ENTROPY=w_t is not None,
        **cfg,
        **LAUNCH,
    )


def _forward(
    hidden,
    weight,
    targets,
    temps,
    vocab_start,
    vocab_size,
    group,
    server=None,
    tile=None,
    keep=None,
    logits_dtype=torch.float32,
    entropy=None,
):
    """fp32 logprobs [T] and fp64 lse [T] with logits in `logits_dtype`. With `keep` (a list) all rows are one
    chunk and the logits slices are kept there for the backward (when the cuBLASLt server runs). `entropy`
    (fp32 [T]) receives each row's full-vocab entropy H = (lse - M) + A / total from the same tiles (A: the
    spread sums, int64 like the total, so no tiling or sharding changes it; no bit contract is claimed)."""
    if logits_dtype not in (torch.float32, torch.bfloat16):
        raise StrictModeError(
            "logprobs", "triton", f"logits dtype {logits_dtype} is outside the contract (float32 or bfloat16)"
        )
    rows, v_local = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    n_tiles = triton.cdiv(v_local, VOCAB_TILE)
    chunk, cols = _forward_geometry(rows, weight, n_tiles, keep is not None, logits_dtype.itemsize)
    temps32 = temps.to(torch.float32)
    tgt = targets.to(torch.int64)
    x = hidden.contiguous()
    big_m = torch.empty(rows, dtype=torch.float32, device=dev)
    total = torch.empty(rows, dtype=torch.int64, device=dev)
    z_t = torch.zeros(rows, dtype=torch.float32, device=dev)
    spread = None if entropy is None else torch.empty(rows, dtype=torch.int64, device=dev)
    for a in range(0, rows, chunk):
        b = min(rows, a + chunk)
        m_t = torch.empty(b - a, n_tiles, dtype=torch.float32, device=dev)
        s_t = torch.empty(b - a, n_tiles, dtype=torch.int64, device=dev)
        w_t = None if entropy is None else torch.empty(b - a, n_tiles, dtype=torch.int64, device=dev)
        _tile_stats_of_rows(
            x[a:b],
            weight,
            temps32[a:b],
            tgt[a:b],
            m_t,
            s_t,
            z_t[a:b],
            vocab_start,
            vocab_size,
            server,
            tile,
            cols,
            keep,
            logits_dtype,
            w_t,
        )
        _row_max_and_total(m_t, s_t, big_m[a:b], total[a:b], group, w_t, None if spread is None else spread[a:b])
        del m_t, s_t, w_t  # before the next chunk's stats are allocated
    exact_all_reduce(z_t, dist.ReduceOp.SUM, group)  # one owner per row: x + 0 + ... + 0 is exact
    lse = _lse(big_m, total, group)  # (sums the totals over the ranks)
    if entropy is not None:
        exact_all_reduce(spread, dist.ReduceOp.SUM, group)
        entropy.copy_((lse - big_m.to(torch.float64)) + spread.to(torch.float64) / total.to(torch.float64))
    return (z_t.to(torch.float64) - lse).to(torch.float32), lse


def _row_max_and_total(m_t, s_t, big_m, total, group, w_t=None, spread=None) -> None:
    """Per row of a chunk's tile stats: M = max of the tile maxima (over the ranks too: exact in any order) into
    big_m, and this rank's int64 total of its tiles' sums rescaled to M into total (with `w_t`, the tiles'
    entropy spreads rescaled the same way into `spread`)."""
    exact_all_reduce(torch.amax(m_t, 1, out=big_m), dist.ReduceOp.MAX, group)
    extra = {} if w_t is None else {"ew_ptr": w_t, "spread_ptr": spread, "ENTROPY": True}
    _total_kernel[(m_t.shape[0],)](
        m_t, s_t, big_m, total, m_t.shape[1], LOG2E=LOG2E, BLOCK=1024, num_warps=4, **extra, **LAUNCH
    )


@triton.jit(do_not_specialize=["rows"])
def _lse_kernel(big_m_ptr, total_ptr, lse_ptr, rows, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """lse = fp64(M) + log64(fp64(total) * 2^-40) per row: torch's `log64` of the same IEEE operations in one
    launch (torch's takes some 40 elementwise kernels, each a host launch in an eager sampling step)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < rows
    big_m = tl.load(big_m_ptr + i, mask=ok, other=0.0).to(tl.float64)
    total = tl.load(total_ptr + i, mask=ok, other=1).to(tl.float64)
    tl.store(lse_ptr + i, big_m + log64(total * f64(SCALE)), mask=ok)


def _lse(big_m: torch.Tensor, total: torch.Tensor, group) -> torch.Tensor:
    """fp64 lse = M + log(total 2^-40) of all rows, the totals summed over the ranks first (int64: exact in any
    order); every total is >= 2^40 (the row's maximum adds exactly 2^40), so log64 meets only normal x >= 1."""
    exact_all_reduce(total, dist.ReduceOp.SUM, group)
    rows = big_m.shape[0]
    lse = torch.empty(rows, dtype=torch.float64, device=big_m.device)
    if rows:
        _lse_kernel[(triton.cdiv(rows, 256),)](
            big_m, total, lse, rows, SCALE=1.0 / (1 << FIXED_POINT_BITS), BLOCK=256, num_warps=4, **LAUNCH
        )
    return lse


@triton.jit(do_not_specialize=["rows"])
def _log_softmax_tail_kernel(
    logits_ptr, temps_ptr, lse_ptr, out_ptr, rows, V, vocab_start, vocab_size, stride_l, stride_o, BLOCK: tl.constexpr
):
    """out = fp32(fp64(z) - lse), z = logits / T (IEEE div) + 0.0 (-0 -> +0, as the stats pass), -inf on columns
    past the real vocab: `full_log_softmax`'s last pass, elementwise, in one launch."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < V
    x = tl.load(logits_ptr + row * stride_l + c, mask=ok, other=0.0).to(tl.float32)
    z = tl.div_rn(x, tl.load(temps_ptr + row)) + 0.0
    y = (z.to(tl.float64) - tl.load(lse_ptr + row)).to(tl.float32)
    y = tl.where(vocab_start + c >= vocab_size, float("-inf"), y)
    tl.store(out_ptr + row * stride_o + c, y, mask=ok)


def full_log_softmax(
    logits32: torch.Tensor,
    temps: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fp32 log-probabilities of every column of this rank's fp32 logits [T, V_local] (the GEMM contract's one
    chain, e.g. `rl_kernel.linear_fp32` of the LM head; -inf on padded columns) under the Triton logprobs
    contract: the entry of a target equals `forward`'s logprob of it bit for bit. temps: fp64 [T] (> 0)."""
    _check(vocab_start, "log_softmax")
    rows, v_local = logits32.shape
    logits = logits32.to(logits_dtype).contiguous()  # the contract's rounding of the chain (none for float32)
    temps32 = temps.to(torch.float32)
    n_tiles = triton.cdiv(v_local, VOCAB_TILE)
    m_t = torch.empty(rows, n_tiles, dtype=torch.float32, device=logits.device)
    s_t = torch.empty(rows, n_tiles, dtype=torch.int64, device=logits.device)
    unused_z = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    no_target = torch.full((rows,), -1, dtype=torch.int64, device=logits.device)
    launch = _stats_launch()
    grid = (triton.cdiv(rows, launch["BLOCK_M"]), triton.cdiv(v_local, launch["BLOCK_N"]))
    _stats_kernel[grid](
        logits,
        temps32,
        no_target,
        m_t,
        s_t,
        unused_z,
        rows,
        v_local,
        0,
        v_local,
        logits.stride(0),
        vocab_start,
        vocab_size,
        n_tiles,
        **launch,
    )
    big_m = torch.empty(rows, dtype=torch.float32, device=logits.device)
    total = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _row_max_and_total(m_t, s_t, big_m, total, group)
    lse = _lse(big_m, total, group)
    out = torch.empty(rows, v_local, dtype=torch.float32, device=logits.device)
    if rows and v_local:
        _log_softmax_tail_kernel[(rows, triton.cdiv(v_local, 1024))](
            logits,
            temps32,
            lse,
            out,
            rows,
            v_local,
            vocab_start,
            vocab_size,
            logits.stride(0),
            out.stride(0),
            BLOCK=1024,
            num_warps=4,
            **LAUNCH,
        )
    return out


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b for 16-bit a, b, accumulated by the GEMM in fp32."""
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def backward(
    grad_out,
    hidden,
    weight,
    targets,
    temps,
    lse,
    vocab_start,
    vocab_size,
    group,
    kept=None,
    grad_entropy=None,
    entropy=None,
):
    """(grad_hidden, grad_weight) by tensor-core GEMMs over vocab slices; fp32 state under the budget.
    `kept`: the forward's logits slices [(first column, logits)] (fp32, or bf16 under a bf16 logit contract), used
    instead of recomputing them. With `grad_entropy` (and the forward's `entropy`) the entropy's gradient too."""
    rows, v_local = hidden.shape[0], weight.shape[0]
    h = hidden.contiguous()
    dtype = h.dtype if h.dtype == weight.dtype and h.dtype in (torch.bfloat16, torch.float16) else torch.float32
    h, w = h.to(dtype), weight.to(dtype)
    grad_h = torch.zeros(rows, h.shape[1], dtype=torch.float32, device=h.device)
    grad_w = torch.empty(v_local, h.shape[1], dtype=dtype, device=h.device)
    temps32, lse32 = temps.to(torch.float32).contiguous(), lse.to(torch.float32).contiguous()
    g32, tgt = grad_out.to(torch.float32).contiguous(), targets.to(torch.int64).contiguous()
    with_entropy = {}
    if grad_entropy is not None:
        with_entropy = {
            "ge_ptr": grad_entropy.to(torch.float32).contiguous(),
            "ent_ptr": entropy.to(torch.float32).contiguous(),
            "ENTROPY": True,
        }
    cols = _slice_cols(rows, weight, 4 + h.element_size())
    bm, bn = 32, 256
    slices = kept or [(c0, None) for c0 in range(0, v_local, cols)]
    while slices:
        c0, logits = slices.pop(0)
        w_s = w[c0 : c0 + (cols if logits is None else logits.shape[1])]
        if logits is None:
            logits = torch.mm(h, w_s.t(), out_dtype=torch.float32) if dtype != torch.float32 else h @ w_s.t()
        dl = torch.empty(rows, w_s.shape[0], dtype=dtype, device=h.device)
        _dlogits_kernel[(triton.cdiv(rows, bm), triton.cdiv(w_s.shape[0], bn))](
            logits,
            dl,
            temps32,
            lse32,
            g32,
            tgt,
            rows,
            w_s.shape[0],
            c0,
            logits.stride(0),
            vocab_start,
            vocab_size,
            LOG2E=LOG2E,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=8,
            **with_entropy,
        )
        del logits
        torch.mm(dl.t(), h, out=grad_w[c0 : c0 + w_s.shape[0]])
        if dtype == torch.float32:
            grad_h += dl @ w_s
        else:
            _addmm_fp32(grad_h, dl, w_s)
        del dl
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(grad_h, group=group)
    return grad_h.to(hidden.dtype), grad_w.to(weight.dtype)


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temps: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    keep: list | None = None,
    logits_dtype: torch.dtype = torch.float32,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The strict forward of `rl_kernel.logprobs` under the Triton contract: (fp32 logprobs [T], fp64 lse [T]).
    temps: fp64 [T] temperatures (> 0); weight: this rank's vocab slice starting at vocab_start; logits_dtype:
    the contract's logit dtype. `keep` (a list) receives the logits slices for `backward`; `entropy` (fp32 [T])
    the full-vocab entropy of each row, from the same tiles."""
    _check(vocab_start)
    return _forward(
        hidden,
        weight,
        targets,
        temps,
        vocab_start,
        vocab_size,
        group,
        keep=keep,
        logits_dtype=logits_dtype,
        entropy=entropy,
    )


def logprobs_and_lse(
    hidden,
    weight,
    targets,
    temps,
    vocab_start=0,
    vocab_size=None,
    group=None,
    *,
    server=None,
    tile=None,
    logits_dtype=torch.float32,
    entropy=None,
):
    """Forward only, for tests and benchmarks: (fp32 logprobs, fp64 lse). `server` ('triton', 'cublaslt')
    and `tile` pick how the logits are computed; neither changes a bit. `entropy`: as `forward`'s."""
    _check(vocab_start)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    return _forward(
        hidden,
        weight,
        targets,
        temps,
        vocab_start,
        vocab_size,
        group,
        server,
        tile,
        logits_dtype=logits_dtype,
        entropy=entropy,
    )
