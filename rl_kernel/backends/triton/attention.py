"""Strict causal GQA attention on Triton: packed varlen prefill and paged KV, one kernel for both.

Contract (triton v1). A program owns BLOCK_M rows (64 in both paths; tests/gpu compare packed prefill with
paged decode bit for bit. A 16-row paged tile gave other bits than the 64-row one at batch >= 64 on the H200,
2026-12-02, same bits at batch 1: benchmarks/results/kernels_decode_h200_quick.json; not yet explained, so
only the 64-row tiles are in the contract): BLOCK_M / G query tokens of one sequence
times the G query heads of one KV head (G = H / Hkv). Keys are taken in chunks of CHUNK = 64
positions counted from position 0 of the sequence; key positions past a row's own are masked
(score -inf, probability 0). Chunks are grouped into KV splits of SPLIT_CHUNKS chunks (a fixed
*size*). Inside a split, online softmax from an empty state: s = dot(q, k) * (scale * log2 e)
(tensor-core dot, fp32), m' = max(m, rowmax s), alpha = exp2(m - m'), p = exp2(s - m'),
l' = l * alpha + rowsum p, o' = dot(p as v's dtype, v) accumulated onto o * alpha. Split partials
merge left to right into (-inf, 0, 0): m = max, both sides rescaled by exp2(m_i - m), added.
out = o / l (IEEE div), rounded once to q's dtype. exp2 is the hardware ex2.approx.f32 (same bits
on the same device type); no FMA anywhere (kernels launched with fp fusion off).

A row's bits depend on its q row and its sequence's keys at positions <= its own only: chunks
past a row's position are exact identities (alpha = 1, p = 0), so packed prefill, paged decode,
chunked prefill, page size, block-table order, batch composition and row placement do not matter.
Two schedules give the same bits: `fused` (one program loops over all splits and merges in
registers) and `split` (one program per split writes its fp32 partial, exactly; in the same launch
the last split program of a tile and kv head to finish, told by an arrival counter, merges them in
split order with the same operations). The fused schedule has two loop forms, nested (a loop per
split) and FLAT (one loop over all chunks, merging and resetting at split boundaries), with the same
operations in the same order. Packed prefill reads the keys of its unmasked chunks through TMA
descriptors where k and v allow one (16-byte strides), otherwise by pointer loads: the same values. A paged
cache whose block size is a multiple of CHUNK (every chunk inside one block: one block-table entry and one TMA
box per chunk) is read through TMA too, masked chunks included: their key slots past the context hold whatever
the cache held there, so v is zeroed there (the pointer loads' `other`) and k's scores are masked as before.
Launch grids depend on tensor shapes only (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH
from rl_kernel.errors import StrictModeError

try:  # the current stream's handle without a Stream object (what Triton's launcher uses)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:

    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


CHUNK = 64
SPLIT_CHUNKS = 8
BLOCK_M = 64  # the paged path's row tile (decode, chunked prefill)
LOG2E = 1.4426950408889634
FOLD_ROWS = tl.constexpr(16)  # rows the split schedule's merge folds at a time (`_merge_tile`)
SPLIT_SCRATCH_BYTES = 256 << 20  # paged calls whose split partials fit use the split schedule
# ... unless the fused schedule alone has FUSED_WAVES x SMs programs (tiles x kv heads): then it keeps the GPU busy
# without the split partials' round trip and the splits past a short context (a table row of max_model_len keys
# has 8 splits of 512; a 512-key context fills one). H200, Qwen3-8B heads, paged decode, fused / split ms:
# B=64 ctx 4096 0.333 / 0.368, B=256 ctx 4096 1.29 / 1.42, B=128 ctx 512 in a 4096-key table 0.115 / 0.227
# (benchmarks/results/kernels_decode_h200_quick.json). B=64 of Qwen3-8B is 68 tiles x 8 kv heads = 4.1 x 132 SMs.
FUSED_WAVES = 4
_SM_COUNT: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 elsewhere: an H200's, so CPU runs pick as it does)."""
    if device.type != "cuda":
        return 132
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def pick_schedule(paged: bool, num_splits: int, scratch_bytes: int, programs: int, sm_count: int) -> str:
    """The paged schedule from shapes only (no host sync; both give the same bits): `split` when the table has
    more than one split, its partials fit SPLIT_SCRATCH_BYTES and the fused grid of `programs` (tiles x kv heads)
    would be under FUSED_WAVES x `sm_count`; `fused` otherwise."""
    few = programs < FUSED_WAVES * sm_count
    return "split" if paged and num_splits > 1 and scratch_bytes <= SPLIT_SCRATCH_BYTES and few else "fused"


# Launch configurations. A row's bits do not depend on the row tile (rows are independent, masked chunks
# are exact identities): tests/gpu compare packed prefill (PREFILL) with paged decode (PAGED) bit for bit.
# Picked by benchmarks/kernels.py's prefill sweep on an H200 (kernels_h200.json).
PAGED = {"BLOCK_M": BLOCK_M, "num_warps": 4, "num_stages": 2, "TMA": True}
# H200, 2026-12-01: keys by TMA descriptors 0.358 / 4.45 ms at T = 4k / 16k, against 0.424 / 5.77 ms by pointer
# loads, 0.465 / 5.83 ms in tile order and 0.506 / 6.23 ms for the 128-row nested form
# (benchmarks/results/prefill_sweep_h200.txt)
PREFILL = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3, "FLAT": True, "HEAVY_FIRST": True, "TMA": True}


@triton.jit
def _program_tile(KV_HEADS, HEAVY_FIRST: tl.constexpr):
    """(global tile index, kv head) of this program. HEAVY_FIRST: one axis of tiles x kv heads, kv head fastest,
    last tile first (under a causal mask the last tiles of a sequence see the most keys, so they start first and
    the light ones fill the tail); otherwise axis 0 is the tile and axis 1 the kv head. No bit depends on it."""
    if HEAVY_FIRST:
        pid = tl.program_id(0)
        return tl.num_programs(0) // KV_HEADS - 1 - pid // KV_HEADS, pid % KV_HEADS
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _first_tile(start_ptr, b, ok, TOKENS_PER_TILE: tl.constexpr):
    """Global index of sequence b's first tile (where `ok`; a large sentinel elsewhere). TOKENS_PER_TILE = 0:
    start holds the first tiles (a cumsum of tile counts). TOKENS_PER_TILE = T > 0: start holds the first
    tokens (cu_seqlens) and the first tile is start[b] // T + b, computed here: strictly increasing in b, and
    sequence b gets start[b + 1] // T - start[b] // T + 1 >= ceil(q_len / T) tile slots (the spare ones run
    no row), all below cu_seqlens[B] // T + B <= cdiv(T_q, T) + B, the launch's upper bound."""
    first = tl.load(start_ptr + b, mask=ok, other=2**30)
    if TOKENS_PER_TILE > 0:
        first = first // TOKENS_PER_TILE + b
    return first


@triton.jit
def _find_tile(pid, start_ptr, B, LOG_B, TOKENS_PER_TILE: tl.constexpr):
    """(b, tile): the sequence b with first tile <= pid < the first tile of b + 1 (binary search, fixed step
    count; first tiles as `_first_tile`) and pid's tile within it (negative for pids before sequence 0's)."""
    lo = pid * 0
    hi = lo + B
    for _ in range(0, LOG_B):
        mid = (lo + hi) // 2
        go_right = _first_tile(start_ptr, mid, hi - lo > 1, TOKENS_PER_TILE) <= pid
        lo = tl.where((hi - lo > 1) & go_right, mid, lo)
        hi = tl.where((hi - lo > 1) & (~go_right), mid, hi)
    return lo, pid - _first_tile(start_ptr, lo, lo >= 0, TOKENS_PER_TILE)


@triton.jit
def _load_kv(
    kv,
    c,
    PAGED: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    TMA: tl.constexpr,
):
    """Chunk c's key positions and k, v [CHUNK, D]. TMA (packed keys' unmasked chunks; a paged cache's chunks,
    each inside one block): by tensor descriptors over [N, Hkv, D] instead of pointer loads (the same values;
    in a masked paged chunk v is zeroed past the context, as the pointer loads' `other`). `kv`: the keys'
    addressing (`_keys`)."""
    k_ptr, v_ptr, k_desc, v_desc, block_table_ptr, stride_bt, b, kv_base, kvh, ctx_len, strides = kv
    stride_kt, stride_kh, stride_vt, stride_vh = strides
    kpos = c * CHUNK + tl.arange(0, CHUNK)
    kv_ok = kpos < ctx_len
    if TMA and (PAGED or not MASKED):
        if PAGED:  # the chunk's block (BLOCK_SIZE % CHUNK == 0), allocated: the chunk starts before ctx_len
            blk = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + (c * CHUNK) // BLOCK_SIZE)
            first = blk * BLOCK_SIZE + (c * CHUNK) % BLOCK_SIZE
        else:
            first = kv_base + c * CHUNK
        k = tl.reshape(k_desc.load([first, kvh, 0]), (CHUNK, D))
        v = tl.reshape(v_desc.load([first, kvh, 0]), (CHUNK, D))
        if MASKED:  # 0 * a stale NaN would reach o; k needs none: its scores are masked to -inf
            v = tl.where(kv_ok[:, None], v, 0.0)
        return kpos, k, v
    d = tl.arange(0, D)
    if PAGED:
        blk = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + kpos // BLOCK_SIZE, mask=kv_ok, other=0)
        row = blk.to(tl.int64) * BLOCK_SIZE + kpos % BLOCK_SIZE
    else:
        row = (kv_base + kpos).to(tl.int64)
    k_off = row[:, None] * stride_kt + kvh.to(tl.int64) * stride_kh + d[None, :]
    v_off = row[:, None] * stride_vt + kvh.to(tl.int64) * stride_vh + d[None, :]
    if MASKED:
        k = tl.load(k_ptr + k_off, mask=kv_ok[:, None], other=0.0)
        v = tl.load(v_ptr + v_off, mask=kv_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_off)
        v = tl.load(v_ptr + v_off)
    return kpos, k, v


@triton.jit
def _chunk_update(
    q, qpos, kpos, k, v, m, l, o, c, qk_scale, MASKED: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr
):
    """One key chunk into the online-softmax state (m, l, o). Unmasked: every key is at or before every
    row's position, so the mask and the per-row skip are identities and are left out."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        live = c * CHUNK <= qpos  # rows with a key in this chunk; for the others the chunk is skipped exactly
        m_new = tl.where(live, tl.maximum(m, tl.max(s, 1)), 0.0)
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l = tl.where(live, l * alpha + tl.sum(p, 1), l)
        o = tl.where(live[:, None], tl.dot(p.to(v.dtype), v, o * alpha[:, None], input_precision=PRECISION), o)
        m = tl.where(live, m_new, m)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        o = tl.dot(p.to(v.dtype), v, o * alpha[:, None], input_precision=PRECISION)
        m = m_new
    return m, l, o


@triton.jit
def _chunk(
    q,
    qpos,
    kv,
    c,
    m,
    l,
    o,
    qk_scale,
    PAGED: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Key chunk c of `kv` (the keys' addressing, `_keys`) loaded (`_load_kv`) and folded into the online-softmax
    state (m, l, o) (`_chunk_update`). MASKED: the chunk holds keys after some row's position (or past the end)."""
    kpos, k, v = _load_kv(kv, c, PAGED, MASKED, BLOCK_SIZE, D, CHUNK, TMA)
    return _chunk_update(q, qpos, kpos, k, v, m, l, o, c, qk_scale, MASKED, CHUNK, PRECISION)


@triton.jit
def _keys(
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    block_table_ptr,
    stride_bt,
    b,
    kv_base,
    kvh,
    ctx_len,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
):
    """The addressing of sequence b's keys of kv head `kvh`, as one tuple (what `_chunk` and the split launches
    take): ctx_len keys, key position p at row kv_base + p (packed) or in the blocks of block table row b (paged),
    k and v strides (token, head) and their tensor descriptors (TMA)."""
    strides = (stride_kt, stride_kh, stride_vt, stride_vh)
    return k_ptr, v_ptr, k_desc, v_desc, block_table_ptr, stride_bt, b, kv_base, kvh, ctx_len, strides


@triton.jit
def _split_partial(
    q,
    qpos,
    kv,
    c_begin,
    c_end,
    c_full,
    qk_scale,
    PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Online softmax over key chunks [c_begin, c_end) of `kv` (`_keys`) from an empty state: (m, l, o), fp32.
    Chunks before `c_full` hold only keys at or before every row's position."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    o = tl.zeros((BLOCK_M, D), tl.float32)
    for c in range(c_begin, tl.minimum(c_end, c_full)):
        m, l, o = _chunk(q, qpos, kv, c, m, l, o, qk_scale, PAGED, False, BLOCK_SIZE, D, CHUNK, PRECISION, TMA)
    for c in range(tl.maximum(c_begin, c_full), c_end):
        m, l, o = _chunk(q, qpos, kv, c, m, l, o, qk_scale, PAGED, True, BLOCK_SIZE, D, CHUNK, PRECISION, TMA)
    return m, l, o


@triton.jit
def _split_boundary(c, m_t, l_t, o_t, m, l, o, SPLIT_CHUNKS: tl.constexpr):
    """At the first chunk of a split after the first: merge the finished split's partial into the total
    and start the next one from an empty state (m = -inf, l = 0, o = 0)."""
    if (c % SPLIT_CHUNKS == 0) & (c > 0):
        m_t, l_t, o_t = _merge(m_t, l_t, o_t, m, l, o)
        m = tl.full(m.shape, float("-inf"), tl.float32)
        l = tl.zeros(l.shape, tl.float32)
        o = tl.zeros(o.shape, tl.float32)
    return m_t, l_t, o_t, m, l, o


@triton.jit
def _all_splits(
    q,
    qpos,
    kv,
    n_chunks,
    c_full,
    qk_scale,
    PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """The fused schedule as one loop over chunks: the same operations as `_split_partial` per split
    followed by `_merge` in split order, with the merge and the reset to an empty state done at each
    split boundary inside the loop (one software pipeline over all chunks instead of one per split)."""
    m_t = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_t = tl.zeros((BLOCK_M,), tl.float32)
    o_t = tl.zeros((BLOCK_M, D), tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    o = tl.zeros((BLOCK_M, D), tl.float32)
    for c in range(0, tl.minimum(n_chunks, c_full)):
        m_t, l_t, o_t, m, l, o = _split_boundary(c, m_t, l_t, o_t, m, l, o, SPLIT_CHUNKS)
        m, l, o = _chunk(q, qpos, kv, c, m, l, o, qk_scale, PAGED, False, BLOCK_SIZE, D, CHUNK, PRECISION, TMA)
    for c in range(c_full, n_chunks):
        m_t, l_t, o_t, m, l, o = _split_boundary(c, m_t, l_t, o_t, m, l, o, SPLIT_CHUNKS)
        m, l, o = _chunk(q, qpos, kv, c, m, l, o, qk_scale, PAGED, True, BLOCK_SIZE, D, CHUNK, PRECISION, TMA)
    return _merge(m_t, l_t, o_t, m, l, o)


@triton.jit
def _merge(m_t, l_t, o_t, m_s, l_s, o_s):
    """Split partial s after total t, in key order; an empty s (no key) leaves t exactly as it is."""
    live = m_s != float("-inf")
    m = tl.where(live, tl.maximum(m_t, m_s), m_t)
    a = tl.math.exp2(m_t - m)
    b = tl.math.exp2(m_s - m)
    l = tl.where(live, l_t * a + l_s * b, l_t)
    o = tl.where(live[:, None], o_t * a[:, None] + o_s * b[:, None], o_t)
    return m, l, o


@triton.jit
def _store_partial(
    m_ptr, l_ptr, o_ptr, STAT_STRIDE: tl.constexpr, O_STRIDE: tl.constexpr, row, m, l, o, keep, D: tl.constexpr
):
    """A split's fp32 state (m, l, o) of each row where `keep`: m, l at m_ptr, l_ptr + row * STAT_STRIDE and
    o at o_ptr + row * O_STRIDE + [0, D)."""
    d = tl.arange(0, D)
    tl.store(m_ptr + row * STAT_STRIDE, m, mask=keep)
    tl.store(l_ptr + row * STAT_STRIDE, l, mask=keep)
    tl.store(o_ptr + row[:, None] * O_STRIDE + d[None, :], o, mask=keep[:, None])


@triton.jit
def _fold(
    m_ptr, l_ptr, o_ptr, STAT_STRIDE: tl.constexpr, O_STRIDE: tl.constexpr, row0, row_step, n, n_max, D: tl.constexpr
):
    """The split schedule's merge of a vector of output rows: the partials (stored as `_store_partial`) at rows
    row0 + s * row_step, s < n (per row; n <= n_max), folded left to right from the empty state with `_merge`,
    then o / l (IEEE div). Steps s >= n of a row read an empty state, which `_merge` leaves out exactly.
    Partials written by other programs of the same launch are read L2-coherent (.cg)."""
    d = tl.arange(0, D)
    m_t = tl.full(row0.shape, float("-inf"), tl.float32)
    l_t = tl.zeros(row0.shape, tl.float32)
    o_t = tl.zeros((row0.shape[0], D), tl.float32)
    for s in range(0, n_max):
        row = row0 + s * row_step
        has = s < n
        m = tl.load(m_ptr + row * STAT_STRIDE, mask=has, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ptr + row * STAT_STRIDE, mask=has, other=0.0, cache_modifier=".cg")
        o = tl.load(o_ptr + row[:, None] * O_STRIDE + d[None, :], mask=has[:, None], other=0.0, cache_modifier=".cg")
        m_t, l_t, o_t = _merge(m_t, l_t, o_t, m, l, o)
    return tl.div_rn(o_t, l_t[:, None])


@triton.jit
def _last_to_arrive(counter_ptr, arrivals):
    """Counts this program's arrival at *counter_ptr; true in exactly one of the `arrivals` programs that count
    there, the last, which also sets the counter back to 0 (a counter is left as found: no fill per launch).

    Memory model: the barrier puts every thread's earlier stores (this program's partial) before the atomic,
    whose release (acq_rel, gpu scope) publishes them; the last arrival's acquire sees every other arrival's
    release, so its loads after the second barrier (all threads) see every partial of the group."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)  # every arrival is in: nothing else touches this counter in this launch
    tl.debug_barrier()
    return last


@triton.jit
def _tile_rows(tile, kvh, r, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """(token within its sequence, head) of rows r of a tile: BLOCK_M / G tokens x the G heads of kv head kvh."""
    return tile * (BLOCK_M // G) + r // G, kvh * G + r % G


@triton.jit
def _partial_row(q0, tok, head, H, NUM_SPLITS):
    """The split partial row of split 0 of (token q0 + tok, head); split s's is s rows on."""
    return ((q0 + tok).to(tl.int64) * H + head) * NUM_SPLITS


@triton.jit
def _merge_tile(
    part_ptr,
    out_ptr,
    q0,
    tile,
    q_len,
    ctx_len,
    kvh,
    n_splits,
    H,
    NUM_SPLITS,
    G: tl.constexpr,
    D: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_CHUNKS: tl.constexpr,
):
    """The split schedule's merge of a tile x kv head: each row's partials, as many as its position has splits
    (computed here, not read from another program), folded with `_fold` and written to out. FOLD_ROWS rows at a
    time: a small state, so the merge does not add to the register pressure of the [BLOCK_M, D] accumulators."""
    rows = G * (tl.minimum((tile + 1) * (BLOCK_M // G), q_len) - tile * (BLOCK_M // G))
    for r0 in range(0, rows, FOLD_ROWS):
        r = r0 + tl.arange(0, FOLD_ROWS)
        tok, head = _tile_rows(tile, kvh, r, G, BLOCK_M)
        ok = r < rows
        splits = tl.where(ok, (ctx_len - q_len + tok) // (CHUNK * SPLIT_CHUNKS) + 1, 0)
        out = _fold(
            part_ptr + D,
            part_ptr + D + 1,
            part_ptr,
            PART,
            PART,
            _partial_row(q0, tok, head, H, NUM_SPLITS),
            1,
            splits,
            n_splits,
            D,
        )
        _store_rows(out_ptr, out, q0, tok, head, ok, H, D)


@triton.jit
def _store_rows(out_ptr, out, q0, tok, head, row_ok, H, D: tl.constexpr):
    """Output rows (token q0 + tok, head) of the contiguous [T, H, D] out, rounded once to its dtype."""
    d = tl.arange(0, D)
    off = ((q0 + tok).to(tl.int64) * H + head)[:, None] * D + d[None, :]
    tl.store(out_ptr + off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# The counts that vary with the batch (sequences, their bit length, splits of the table's width, the table's row
# stride) are not specialized on (== 1, divisible by 16): one compile per constexpr choice, which the strict vLLM
# model's warm-up makes before serving (rl_kernel.integrations.vllm.warmup).
@triton.jit(do_not_specialize=["B", "LOG_B", "NUM_SPLITS", "stride_bt"])
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    out_ptr,
    part_ptr,
    counter_ptr,
    lse_ptr,
    q_start_ptr,
    ctx_len_ptr,
    block_table_ptr,
    B,
    LOG_B,
    NUM_SPLITS,
    KV_HEADS,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_lse_h,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGED: tl.constexpr,
    STORE_LSE: tl.constexpr,
    SPLIT: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    FLAT: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    TMA: tl.constexpr,
):
    """Rows of tile `pid` x kv head `kvh` (`_program_tile`; tiles as `_find_tile` over q_start). out: contiguous
    [T, H, D]. SPLIT: grid axis 2 is the split s < NUM_SPLITS; partial rows of PART floats (o, m, l) at
    part_ptr, ((token * H + head) * NUM_SPLITS + s) * PART; counter_ptr: one zeroed int32 per (tile, kv head)."""
    pid, kvh = _program_tile(KV_HEADS, HEAVY_FIRST)
    b, tile = _find_tile(pid, q_start_ptr, B, LOG_B, BLOCK_M // G)
    q0 = tl.load(q_start_ptr + b)
    q_len = tl.load(q_start_ptr + b + 1) - q0
    # tile slots past a sequence's last tile (the grid and the tile spacing are upper bounds) run no row
    tile_ok = (tile >= 0) & (tile * (BLOCK_M // G) < q_len)
    ctx_len = tl.load(ctx_len_ptr + b)
    tok, head = _tile_rows(tile, kvh, tl.arange(0, BLOCK_M), G, BLOCK_M)
    row_ok = (tok >= 0) & (tok < q_len)  # rows of this program that hold a query (none where not tile_ok)
    H = KV_HEADS * G
    qpos = ctx_len - q_len + tok
    d = tl.arange(0, D)
    q_off = (q0 + tok).to(tl.int64)[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    last_pos = ctx_len - q_len + tl.minimum((tile + 1) * (BLOCK_M // G), q_len) - 1
    c_full = (ctx_len - q_len + tile * (BLOCK_M // G) + 1) // CHUNK  # chunks every row of the tile sees whole
    n_chunks = tl.where(tile_ok, last_pos // CHUNK + 1, 0)
    n_splits = tl.cdiv(n_chunks, SPLIT_CHUNKS)
    kv = _keys(
        k_ptr, v_ptr, k_desc, v_desc, block_table_ptr, stride_bt, b, q0, kvh, ctx_len,
        stride_kt, stride_kh, stride_vt, stride_vh,
    )  # fmt: skip
    if SPLIT:
        s = tl.program_id(2)
        c0 = s * SPLIT_CHUNKS  # a split past the tile's last one runs no chunk and stores nothing
        m, l, o = _split_partial(
            q, qpos, kv, c0, tl.minimum(c0 + SPLIT_CHUNKS, n_chunks), c_full, qk_scale,
            PAGED, BLOCK_SIZE, D, CHUNK, BLOCK_M, PRECISION, TMA,
        )  # fmt: skip
        _store_partial(
            part_ptr + D,
            part_ptr + D + 1,
            part_ptr,
            PART,
            PART,
            _partial_row(q0, tok, head, H, NUM_SPLITS) + s,
            m,
            l,
            o,
            row_ok & (tok < tl.where(s < n_splits, q_len, 0)),
            D,
        )
        # every split program of a tile with rows counts (those past its last split too); the last one merges
        if tile_ok:
            if _last_to_arrive(counter_ptr + pid * KV_HEADS + kvh, NUM_SPLITS):
                _merge_tile(
                    part_ptr,
                    out_ptr,
                    q0,
                    tile,
                    q_len,
                    ctx_len,
                    kvh,
                    n_splits,
                    H,
                    NUM_SPLITS,
                    G,
                    D,
                    PART,
                    BLOCK_M,
                    CHUNK,
                    SPLIT_CHUNKS,
                )
    else:
        if FLAT:
            m_t, l_t, o_t = _all_splits(
                q,
                qpos,
                kv,
                n_chunks,
                c_full,
                qk_scale,
                PAGED,
                BLOCK_SIZE,
                D,
                CHUNK,
                SPLIT_CHUNKS,
                BLOCK_M,
                PRECISION,
                TMA,
            )
        else:
            m_t = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_t = tl.zeros((BLOCK_M,), tl.float32)
            o_t = tl.zeros((BLOCK_M, D), tl.float32)
            for s in range(0, n_splits):
                c0 = s * SPLIT_CHUNKS
                m, l, o = _split_partial(
                    q, qpos, kv, c0, tl.minimum(c0 + SPLIT_CHUNKS, n_chunks), c_full, qk_scale,
                    PAGED, BLOCK_SIZE, D, CHUNK, BLOCK_M, PRECISION, TMA,
                )  # fmt: skip
                m_t, l_t, o_t = _merge(m_t, l_t, o_t, m, l, o)
        _store_rows(out_ptr, tl.div_rn(o_t, l_t[:, None]), q0, tok, head, row_ok, H, D)
        if STORE_LSE:  # natural log-sum-exp of the scaled scores, for the backward only (no bit contract)
            lse = (m_t + tl.log2(l_t)) * 0.6931471805599453
            tl.store(lse_ptr + head.to(tl.int64) * stride_lse_h + q0 + tok, lse, mask=row_ok)


def _check(q: torch.Tensor, kv_heads: int, block_m: int) -> tuple[int, int]:
    heads, d = q.shape[1], q.shape[2]
    g = heads // kv_heads
    if g * kv_heads != heads or g & (g - 1) or g > block_m:
        raise StrictModeError(
            "attention",
            "triton",
            f"{heads} query heads over {kv_heads} kv heads: the kernel "
            f"packs G = H / Hkv heads per row block and needs G a power of two <= {block_m}",
        )
    if d & (d - 1) or d < 16:
        raise StrictModeError("attention", "triton", f"head_dim {d} must be a power of two >= 16")
    return g, d


def _precision(q: torch.Tensor, k: torch.Tensor) -> str:
    if q.dtype != k.dtype:
        raise StrictModeError("attention", "triton", f"q is {q.dtype} but the keys are {k.dtype}; pass one dtype")
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _descriptors(k: torch.Tensor, v: torch.Tensor, block_size: int | None = None):
    """TMA descriptors of packed k, v [N, Hkv, d] with [CHUNK, 1, d] blocks, or (None, None) where TMA cannot
    read them (16-byte strides and base; a Triton without host descriptors); the pointer loads then serve (the
    same values). `block_size`: k, v are a paged cache [blocks, block_size, Hkv, d] with contiguous blocks, read
    as its [blocks * block_size, Hkv, d] rows; only where every chunk lies inside one block."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None, None
    if block_size is not None:
        if block_size % CHUNK:
            return None, None
        k, v = k.flatten(0, 1), v.flatten(0, 1)

    def fits(t):
        return (
            t.stride(-1) == 1
            and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0
        )

    if not (fits(k) and fits(v)):
        return None, None
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [CHUNK, 1, t.shape[-1]]) for t in (k, v))


def _partial_floats(d: int) -> int:
    """Floats per split-partial row: o (d), m, l and 2 of padding, so that every row's o is 16-byte aligned."""
    return d + 4


# Arrival counters of the split schedule, per (device, stream): int32, zero between launches (the last arrival
# of every (tile, kv head) resets its own counter), so a call needs no fill. Why cached rather than a zeroed
# tensor per call: one host op and one memset less per decode step. Per stream: launches on two streams may run
# at once and must not share counters (one stream's launches run one after the other). A buffer is never freed:
# one allocated inside a CUDA-graph capture (the capture stream's, on its first use; the zeros are then a node of
# the graph, harmless at replay) or replaced by a larger one may still be used by a captured graph's replays.
# Two graphs captured on one stream share its buffer: replay them on one stream, not concurrently.
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []
_MIN_COUNTERS = 1 << 14  # (tiles x kv heads) of a decode batch of 1024 sequences with 8 kv heads fit


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters for split launches on `device`'s current stream (see _COUNTERS)."""
    key = (device, _raw_stream(device.index) if device.type == "cuda" else None)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < n:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = _COUNTERS[key] = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
    return counters


def _run(q, k, v, q_start, ctx_len, block_table, block_size, scale, paged, schedule, lse=None, config=None):
    """q [T, H, d]; k, v [..., N, Hkv, d] with keys at row * stride(-3) (paged: a cache [blocks, block_size, Hkv, d]
    with contiguous blocks, row = block * block_size + offset; packed: [T, Hkv, d]); q_start [B + 1] and ctx_len [B]
    int; block_table [B, max_blocks] int32 (paged only). Returns a new contiguous [T, H, d] in q's dtype; rows of no
    sequence (past q_start[B]: the padding of a CUDA-graph batch) are 0 in paged calls (one memset: no program
    covers them), unwritten in packed ones."""
    tq, heads, _ = q.shape
    kv_heads = k.shape[-2]
    cfg = dict(config or (PAGED if paged else PREFILL))
    block_m = cfg.pop("BLOCK_M")
    flat, heavy_first, tma = cfg.pop("FLAT", False), cfg.pop("HEAVY_FIRST", False), cfg.pop("TMA", False)
    g, d = _check(q, kv_heads, block_m)
    precision = _precision(q, k)
    out = (torch.zeros_like if paged else torch.empty_like)(q, memory_format=torch.contiguous_format)
    b = ctx_len.numel()
    if tq == 0 or b == 0:
        return out
    dev = q.device
    q_start = q_start.to(device=dev, dtype=torch.int32).contiguous()
    ctx_len = ctx_len.to(device=dev, dtype=torch.int32).contiguous()
    grid_tiles = triton.cdiv(tq, block_m // g) + b  # upper bound on the tile slots (`_first_tile`); no host sync
    num_splits = triton.cdiv(block_table.shape[1] * block_size if paged else tq, CHUNK * SPLIT_CHUNKS)
    if schedule is None:  # one split: the fused schedule runs the same programs without the partials' round trip
        scratch = tq * heads * num_splits * _partial_floats(d) * 4
        schedule = pick_schedule(paged, num_splits, scratch, grid_tiles * kv_heads, _sm_count(dev))
    split = schedule == "split"
    part = torch.empty(tq * heads * num_splits * _partial_floats(d), dtype=torch.float32, device=dev) if split else None
    counters = _arrival_counters(dev, grid_tiles * kv_heads) if split else None
    k_desc, v_desc = _descriptors(k, v, block_size if paged else None) if tma else (None, None)
    use_tma = k_desc is not None
    grid = (grid_tiles * kv_heads, 1) if heavy_first else (grid_tiles, kv_heads)
    # `_keys` packs the descriptors and the block table into one tuple, and Triton before 3.9 cannot put a None
    # into a tuple: where there is none, the k and v pointers and ctx_len stand in (read under no constexpr branch)
    _attn_kernel[grid + (num_splits if split else 1,)](
        q,
        k,
        v,
        k_desc if use_tma else k,
        v_desc if use_tma else v,
        out,
        part,
        counters,
        lse,
        q_start,
        ctx_len,
        block_table if paged else ctx_len,
        b,
        b.bit_length(),
        num_splits,
        kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(-3),
        k.stride(-2),
        v.stride(-3),
        v.stride(-2),
        block_table.stride(0) if paged else 0,
        0 if lse is None else lse.stride(0),
        float(scale) * LOG2E,
        G=g,
        D=d,
        PAGED=paged,
        STORE_LSE=lse is not None,
        SPLIT=split,
        PART=_partial_floats(d),
        BLOCK_SIZE=block_size,
        CHUNK=CHUNK,
        SPLIT_CHUNKS=SPLIT_CHUNKS,
        BLOCK_M=block_m,
        PRECISION=precision,
        FLAT=flat,
        HEAVY_FIRST=heavy_first,
        TMA=use_tma,
        **cfg,
        **LAUNCH,
    )
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    schedule: str | None = None,
    lse: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, H, d], k, v [T, Hkv, d], cu_seqlens [B+1].

    `lse`, an fp32 [H, T] tensor, receives each row's natural log-sum-exp of the scaled scores (for a
    flash-attention backward; fused schedule only). It is outside the contract: no bit promise."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu = cu_seqlens.to(torch.int32)
    if lse is not None and (schedule or "fused") != "fused":
        raise ValueError("the log-sum-exp output needs the fused schedule")
    return _run(q, k, v, cu, cu[1:] - cu[:-1], None, 1, scale, False, schedule or "fused", lse, config)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    schedule: str | None = None,
) -> torch.Tensor:
    """Causal attention of new queries over a paged KV cache [num_blocks, block_size, Hkv, d]."""
    bs = k_cache.shape[1]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1 or cache.stride(0) != bs * cache.stride(1):
            raise StrictModeError(
                "attention",
                "triton",
                f"{name} must have contiguous blocks (stride(0) == block_size * stride(1), unit last stride)",
            )
    q = q if q.stride(-1) == 1 else q.contiguous()
    table = block_table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()  # the kernel reads a row's entries at unit stride
    return _run(q, k_cache, v_cache, query_start_loc, seq_lens, table, bs, scale, True, schedule)


# ---- context parallelism: one split's partial for gathered queries, and the ordered fold ----------------


@triton.jit
def _cp_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pm_ptr,
    pl_ptr,
    po_ptr,
    q_row_ptr,
    pos0_ptr,
    out_row_ptr,
    kv_base_ptr,
    seq_len_ptr,
    split_ptr,
    tile_start_ptr,
    B,
    LOG_B,
    H,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Task b: query rows q_row[b] + j (positions pos0[b] + j, j < tile_start-derived length) against
    the keys of split split[b] of a sequence of seq_len[b] keys, key position p at row kv_base[b] + p.
    Writes the split's exact fp32 partial (m, l, o) of each row at out_row[b] + j (`_split_partial`)."""
    b, tile = _find_tile(tl.program_id(0), tile_start_ptr, B, LOG_B, 0)
    q_len = tl.load(pos0_ptr + B + b)  # pos0_ptr holds [pos0 (B), q_len (B)]
    tile_ok = tile < tl.load(tile_start_ptr + b + 1) - tl.load(tile_start_ptr + b)
    kvh = tl.program_id(1)
    tok, head = _tile_rows(tile, kvh, tl.arange(0, BLOCK_M), G, BLOCK_M)
    row_ok = tok < tl.where(tile_ok, q_len, 0)
    qpos = tl.load(pos0_ptr + b) + tok
    d = tl.arange(0, D)
    q_off = (
        (tl.load(q_row_ptr + b) + tok).to(tl.int64)[:, None] * stride_qt
        + head.to(tl.int64)[:, None] * stride_qh
        + d[None, :]
    )
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    c0 = tl.load(split_ptr + b) * SPLIT_CHUNKS
    kv_base = tl.load(kv_base_ptr + b)
    ctx_len = tl.load(seq_len_ptr + b)
    rows = tl.sum(row_ok.to(tl.int32), 0)
    last_pos = tl.load(pos0_ptr + b) + tile * (BLOCK_M // G) + rows // G - 1
    c_end = tl.where(rows > 0, tl.minimum(c0 + SPLIT_CHUNKS, last_pos // CHUNK + 1), c0)
    c_full = (tl.load(pos0_ptr + b) + tile * (BLOCK_M // G) + 1) // CHUNK  # chunks every row sees whole
    # packed keys by pointer: no block table (kv_base_ptr stands in, never read) and no descriptors
    kv = _keys(
        k_ptr, v_ptr, k_ptr, v_ptr, kv_base_ptr, 0, b, kv_base, kvh, ctx_len, stride_kt, stride_kh, stride_vt, stride_vh
    )
    m, l, o = _split_partial(q, qpos, kv, c0, c_end, c_full, qk_scale, False, 1, D, CHUNK, BLOCK_M, PRECISION, False)
    prow = (tl.load(out_row_ptr + b) + tok).to(tl.int64) * H + head
    _store_partial(pm_ptr, pl_ptr, po_ptr, 1, D, prow, m, l, o, row_ok, D)


@triton.jit
def _fold_kernel(pm_ptr, pl_ptr, po_ptr, start_ptr, out_ptr, H, stride_ot, stride_oh, D: tl.constexpr):
    """Row t: fold partials start[t] .. start[t + 1] - 1 (its splits in key order), stored [N, H(, D)], with
    `_fold`: the split schedule's merge."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    first = tl.load(start_ptr + t)
    n = tl.load(start_ptr + t + 1) - first
    row0 = (tl.zeros((1,), tl.int64) + first) * H + h
    out = _fold(pm_ptr, pl_ptr, po_ptr, 1, D, row0, H, tl.zeros((1,), tl.int32) + n, n, D)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty)
    )


def split_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_row: torch.Tensor,
    pos0: torch.Tensor,
    q_len: torch.Tensor,
    out_row: torch.Tensor,
    kv_base: torch.Tensor,
    seq_len: torch.Tensor,
    split: torch.Tensor,
    n_out: int,
    scale: float,
    *,
    split_chunks: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split partials of the Triton contract for context parallelism (`integrations/megatron/cp.py`).

    Task i (all task tensors int, [n_tasks]): the q_len[i] query rows q[q_row[i] + j] at positions
    pos0[i] + j of one sequence of seq_len[i] keys, against key split split[i] (key positions
    [split * S * 64, (split + 1) * S * 64), S = `split_chunks`, default SPLIT_CHUNKS), key position p at
    row kv_base[i] + p of k, v [N, Hkv, d]. Needs pos0[i] >= split[i] * S * 64 and every key of the
    split that some row sees present in k, v. Returns fp32 (m [n_out, H], l [n_out, H], o [n_out, H, d]),
    row out_row[i] + j holding the split's state (m, l, o) after its online softmax from the empty state,
    the bits `varlen_attention`'s split schedule writes for that row and split (rows are independent:
    no bit depends on the task or tile a row is computed in). Rows not covered by a task are left as is.
    """
    heads = q.shape[1]
    cfg = dict(config or PREFILL)
    block_m = cfg.pop("BLOCK_M")
    cfg.pop("FLAT", None)  # one split per program here: nothing to flatten
    cfg.pop("HEAVY_FIRST", None)  # (its own grid)
    cfg.pop("TMA", None)
    g, d = _check(q, k.shape[1], block_m)
    precision = _precision(q, k)
    dev, i32 = q.device, torch.int32
    m = torch.empty(n_out, heads, dtype=torch.float32, device=dev)
    l, o = torch.empty_like(m), torch.empty(n_out, heads, d, dtype=torch.float32, device=dev)
    tasks = q_len.numel()
    if tasks == 0 or n_out == 0:
        return m, l, o
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    tokens = block_m // g
    as32 = [t.to(device=dev, dtype=i32).contiguous() for t in (q_row, out_row, kv_base, seq_len, split)]
    q_len32 = q_len.to(device=dev, dtype=i32)
    pos_len = torch.cat([pos0.to(device=dev, dtype=i32), q_len32])
    tile_start = torch.zeros(tasks + 1, dtype=i32, device=dev)
    tile_start[1:] = torch.cumsum((q_len32 + tokens - 1) // tokens, 0)
    grid = (triton.cdiv(n_out, tokens) + tasks, k.shape[1])  # upper bound on the tiles; no host sync
    _cp_split_kernel[grid](
        q,
        k,
        v,
        m,
        l,
        o,
        as32[0],
        pos_len,
        as32[1],
        as32[2],
        as32[3],
        as32[4],
        tile_start,
        tasks,
        tasks.bit_length(),
        heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        float(scale) * LOG2E,
        G=g,
        D=d,
        CHUNK=CHUNK,
        SPLIT_CHUNKS=split_chunks or SPLIT_CHUNKS,
        BLOCK_M=block_m,
        PRECISION=precision,
        **cfg,
        **LAUNCH,
    )
    return m, l, o


def fold_partials(
    m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, start: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Output rows from split partials: row t folds partial rows start[t] .. start[t+1]-1 (m, l [N, H] and
    o [N, H, d] fp32, its splits in key order, one per split from split 0) left to right from the empty
    state, then o / l (IEEE div) rounded to `dtype`: the split schedule's merge, bit for bit."""
    rows, heads, d = start.numel() - 1, m.shape[1], o.shape[2]
    out = torch.empty(rows, heads, d, dtype=dtype, device=m.device)
    if rows and heads:
        _fold_kernel[(rows, heads)](
            m.contiguous(),
            l.contiguous(),
            o.contiguous(),
            start.to(device=m.device, dtype=torch.int32).contiguous(),
            out,
            heads,
            out.stride(0),
            out.stride(1),
            D=d,
            num_warps=1,
            **LAUNCH,
        )
    return out
