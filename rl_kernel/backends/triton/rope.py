"""Strict rotary embedding on Triton (neox / Qwen3 layout), the torch contract's operations.

(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, each product and sum rounded (no FMA),
rounded once to x's dtype. cos/sin are the torch backend's fp32 values: read from the caller's table
(`rotate`), or found from each token's position (`rotate_at`, `qk_norm_rope`) by the twins of the
torch backend's fp64 exp64 / log64 / sincos64, the same operations in the same order, so the same
bits without the ~100 small launches that the torch backend's table takes. Those twins run once per
(theta, rotary_dim, device), over positions [0, TABLE_POSITIONS), into a cached angle table
(`angle_table`, one launch); the kernels read a token's row there and compute the angles in the
kernel only for positions past it (or while a CUDA graph is captured before any table exists).
Both ways are the same code, so the same bits. Dims past rotary_dim pass through unchanged.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH, exp64, f64, log64, sincos64, tree_sum

TABLE_POSITIONS = 1 << 15  # positions in the angle table: [32768, 2, rotary_dim / 2] fp32, 16 MiB at rotary 128


@triton.jit
def _cos_sin_at(pos, theta_bits, i, ROTARY: tl.constexpr):
    """The torch backend's fp32 cos, sin of angle pos * theta^(-2i / ROTARY), in fp64 as its cos_sin."""
    theta = theta_bits.to(tl.int64).to(tl.float64, bitcast=True)
    two_i = (2 * i).to(tl.float64)
    inv_freq = exp64(-(two_i / f64(ROTARY)) * log64(tl.zeros_like(two_i) + theta))
    sin, cos = sincos64(pos.to(tl.float64) * inv_freq)
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _cos_sin_of(pos_ptr, t, table_ptr, table_len, theta_bits, i, i_ok, HALF: tl.constexpr, ROTARY: tl.constexpr):
    """cos, sin [BLOCK_HALF] of token t: its row of the angle table where pos[t] < table_len, else computed."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if pos < table_len:
        row = table_ptr + pos * (2 * HALF)
        c = tl.load(row + i, mask=i_ok, other=0.0)
        s = tl.load(row + HALF + i, mask=i_ok, other=0.0)
    else:
        c, s = _cos_sin_at(pos, theta_bits, i, ROTARY)
    return c, s


@triton.jit
def _angle_table_kernel(table_ptr, theta_bits, HALF: tl.constexpr, ROTARY: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Row p of the table [P, 2, HALF]: `_cos_sin_at(p)`, cos then sin."""
    pos = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    c, s = _cos_sin_at(pos, theta_bits, i, ROTARY)
    tl.store(table_ptr + pos * (2 * HALF) + i, c, mask=i_ok)
    tl.store(table_ptr + pos * (2 * HALF) + HALF + i, s, mask=i_ok)


_ANGLE_TABLES: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _theta_bits(theta: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(theta)))[0]  # fp64 bits: a Python float arg is fp32


def angle_table(theta: float, rotary_dim: int, device: torch.device) -> torch.Tensor | None:
    """The contract's fp32 (cos, sin) of positions [0, TABLE_POSITIONS): [TABLE_POSITIONS, 2, rotary_dim / 2], built
    on `device` at the first call for (theta, rotary_dim, device) by the kernels' own angle code, then cached. None
    while the current stream is being captured into a CUDA graph and no table exists yet (a launch captured into
    a graph would fill it only at replay): the kernels then compute every angle, the same bits."""
    key = (_theta_bits(theta), rotary_dim, torch.device(device))
    table = _ANGLE_TABLES.get(key)
    if table is not None or TABLE_POSITIONS == 0:
        return table
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    table = torch.empty(TABLE_POSITIONS, 2, rotary_dim // 2, dtype=torch.float32, device=device)
    _fill_angle_table(table, key[0], rotary_dim)
    _ANGLE_TABLES[key] = table
    return table


def _fill_angle_table(table: torch.Tensor, theta_bits: int, rotary_dim: int) -> None:
    """Every row of `table` [P, 2, rotary_dim / 2] written by `_angle_table_kernel`, in place (one launch)."""
    half = rotary_dim // 2
    _angle_table_kernel[(table.shape[0],)](
        table, theta_bits, HALF=half, ROTARY=rotary_dim, BLOCK_HALF=triton.next_power_of_2(half), num_warps=1, **LAUNCH
    )


def refill_angle_tables() -> None:
    """Write every cached angle table again, in place (same addresses: CUDA graphs that read them stay valid). For
    memory whose content an engine may have dropped while keeping its addresses (vLLM's sleep level 2 discards the
    weights pool, where an engine's first forward, inside `load_weights`, allocated its tables)."""
    for (theta_bits, rotary_dim, _), table in _ANGLE_TABLES.items():
        _fill_angle_table(table, theta_bits, rotary_dim)


def _table_args(theta: float, rotary_dim: int, device: torch.device, use_table: bool) -> tuple[torch.Tensor, int]:
    """(table, rows to read from it) for a kernel launch; without a table an fp32 stand-in (one launch signature)
    and 0 rows, so that the kernel computes every angle."""
    table = angle_table(theta, rotary_dim, device) if use_table else None
    if table is None:
        return torch.empty(1, dtype=torch.float32, device=device), 0
    return table, table.shape[0]


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
    table_ptr,
    table_len,
    theta_bits,
    HALF: tl.constexpr,
    ROTARY: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    AT_POSITIONS: tl.constexpr,
):
    """AT_POSITIONS: cos/sin of pos[t] (`_cos_sin_of`: the angle table's row, or computed from theta's fp64 bits);
    otherwise from the caller's tables' row t."""
    t = tl.program_id(0).to(tl.int64)  # T x H x d passes 2^31 at 524k tokens of 32 x 128 query heads
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    if AT_POSITIONS:
        c, s = _cos_sin_of(pos_ptr, t, table_ptr, table_len, theta_bits, i, i_ok, HALF, ROTARY)
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


def rotate_at(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int, *, use_table: bool = True
) -> torch.Tensor:
    """x [T, H, d] rotated at positions [T] (int, >= 0) with the contract's cos/sin found in the kernel (the angle
    table's rows, `angle_table`; use_table=False: every angle computed, the same bits): the bits of
    `rotate(x, *cos_sin(positions, rotary_dim, theta), rotary_dim)`. Returns x's shape and dtype."""
    if theta <= 0:
        raise ValueError(f"rope theta must be > 0, got {theta}")
    return _launch(x, rotary_dim, None, None, positions.contiguous(), theta, 0, use_table)


def _launch(x, rotary_dim, cos, sin, positions, theta, stride_c, use_table: bool = False) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t == 0 or h == 0:
        return out
    half = rotary_dim // 2
    block_h = min(16, triton.next_power_of_2(h))
    at_positions = positions is not None
    table, table_len = _table_args(theta, rotary_dim, x.device, at_positions and use_table)
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
        table,
        table_len,
        _theta_bits(theta),
        HALF=half,
        ROTARY=rotary_dim,
        D=d,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)),
        AT_POSITIONS=at_positions,
        num_warps=4,
        **LAUNCH,
    )
    return out


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,
    w_ptr,
    w2_ptr,
    pos_ptr,
    out_ptr,
    H,
    W2_FROM,
    stride_xt,
    stride_xh,
    eps,
    table_ptr,
    table_len,
    theta_bits,
    D: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    HALF: tl.constexpr,
    ROTARY: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Heads of token t (program (t, head block)) of x [T, H, D] (unit last stride): the norm kernel's RMSNorm
    (`norm._rms_norm_kernel` with TWO_WEIGHTS: w2 where h >= W2_FROM) then `_rope_kernel` at pos[t] into out,
    contiguous [T, H, D]. The same operations in the same order as the two kernels, the normed head rounded to
    x's dtype between them as when it is stored; only the store and the reload in between are gone."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    base = x_ptr + (t * stride_xt + heads.to(tl.int64)[:, None] * stride_xh)  # [BLOCK_H, 1]
    obase = out_ptr + (t * (H * D) + heads.to(tl.int64)[:, None] * D)
    # sum of squares: 64-element blocks, a pairwise tree inside each, the block sums left to right
    blk = tl.arange(0, BLOCK_NB)
    cols = blk[:, None] * 64 + tl.arange(0, 64)[None, :]  # [BLOCK_NB, 64]
    x = tl.load(base[:, :, None] + cols[None, :, :], mask=h_ok[:, None, None] & (cols < D)[None, :, :], other=0.0)
    sq = x.to(tl.float32)
    sq = sq * sq
    sums = tl.reshape(tree_sum(tl.reshape(sq, (BLOCK_H * BLOCK_NB, 64)), 6), (BLOCK_H, BLOCK_NB))
    acc = tl.sum(tl.where(blk[None, :] == 0, sums, 0.0), axis=1)  # one nonzero term: the block sum exactly
    for b in tl.static_range(1, NB):
        acc = acc + tl.sum(tl.where(blk[None, :] == b, sums, 0.0), axis=1)
    mean = tl.div_rn(acc, tl.full((BLOCK_H,), D, tl.float32))
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))[:, None]
    second = (heads >= W2_FROM)[:, None]

    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    mask = h_ok[:, None] & i_ok[None, :]
    x1 = tl.load(base + i[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + HALF + i[None, :], mask=mask, other=0.0)
    y1 = _normed(x1, inv_rms, w_ptr, w2_ptr, i, i_ok, second)
    y2 = _normed(x2, inv_rms, w_ptr, w2_ptr, HALF + i, i_ok, second)
    c, s = _cos_sin_of(pos_ptr, t, table_ptr, table_len, theta_bits, i, i_ok, HALF, ROTARY)
    c, s = c[None, :], s[None, :]
    a, b = y1.to(tl.float32), y2.to(tl.float32)
    tl.store(obase + i[None, :], (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(obase + HALF + i[None, :], (b * c + a * s).to(x1.dtype), mask=mask)
    if D > 2 * HALF:
        j = 2 * HALF + tl.arange(0, BLOCK_D)
        j_ok = j < D
        jmask = h_ok[:, None] & j_ok[None, :]
        xj = tl.load(base + j[None, :], mask=jmask, other=0.0)
        tl.store(obase + j[None, :], _normed(xj, inv_rms, w_ptr, w2_ptr, j, j_ok, second), mask=jmask)


@triton.jit
def _normed(x, inv_rms, w_ptr, w2_ptr, c, c_ok, second):
    """round(round(x * inv_rms) * w) in x's dtype, w the row's weight at columns c, as the norm kernel."""
    w = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    w = tl.where(second, tl.load(w2_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :], w)
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
    return (normed.to(tl.float32) * w).to(x.dtype)


def qk_norm_rope(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_heads: int,
    eps: float,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int,
    *,
    use_table: bool = True,
) -> torch.Tensor:
    """Qwen3's QK-norm then RoPE in one launch: the bits of `rotate_at(norm.rms_norm_heads(qk, q_weight, k_weight,
    q_heads, eps), positions, theta, rotary_dim)`. qk [T, H, D] (a strided view of the fused QKV is read in place,
    unit last stride), positions [T] (int, >= 0); use_table as `rotate_at`'s. Returns a new contiguous [T, H, D] in
    qk's dtype."""
    if qk.dim() != 3 or qk.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope takes qk [T, H, D] with a unit last stride, got {list(qk.shape)}")
    if theta <= 0:
        raise ValueError(f"rope theta must be > 0, got {theta}")
    t, h, d = qk.shape
    if not 0 < rotary_dim <= d or rotary_dim % 2:
        raise ValueError(f"qk_norm_rope: rotary_dim must be even and in (0, {d}], got {rotary_dim}")
    out = torch.empty((t, h, d), dtype=qk.dtype, device=qk.device)
    if t == 0 or h == 0:
        return out
    half, nb = rotary_dim // 2, triton.cdiv(d, 64)
    block_h = min(16, triton.next_power_of_2(h))
    table, table_len = _table_args(theta, rotary_dim, qk.device, use_table)
    _qk_norm_rope_kernel[(t, triton.cdiv(h, block_h))](
        qk, q_weight.contiguous(), k_weight.contiguous(), positions.contiguous(), out,
        h, q_heads, qk.stride(0), qk.stride(1), eps, table, table_len, _theta_bits(theta),
        D=d, NB=nb, BLOCK_NB=triton.next_power_of_2(nb), HALF=half, ROTARY=rotary_dim, BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)), BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)),
        num_warps=4, **LAUNCH,
    )  # fmt: skip
    return out
