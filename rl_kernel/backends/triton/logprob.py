"""Strict fused linear-logprob on Triton: hidden x LM head -> selected-token fp32 logprob, without
ever holding [T, V] logits.

Contract (triton v1). Logits are fp32 tiles of the Triton GEMM contract (the same kernel code and
tile as `matmul_fp32`). z = logits / fp32(temperature) (IEEE div); columns past the real vocab are
-inf. The vocab is cut into fixed tiles of VOCAB_TILE = 64 columns counted from column 0 of the
full vocab. Per (row, tile): m_j = max z (exact) and S_j = sum of rint(exp2((z - m_j) log2 e) 2^40)
in int64 (exp2 = hardware ex2.approx.f32). Per row: M = max_j m_j (exact), total = sum_j
rint(S_j * exp2((m_j - M) log2 e)) in int64 (fp64 product), lse = M + log(total 2^-40) in fp64
(rl_kernel's log64), logprob = z[target] - lse rounded once to fp32. Every sum is an integer sum,
so rows, tiles, kernel schedules and vocab sharding (slices of whole tiles, any rank order) give
the same bits. Rows are processed in chunks whose per-tile state stays under a tenth of the LM
head's bytes. Backward: p = exp(z - lse) recomputed per row tile in fp32 with torch matmuls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from rl_kernel.backends.torch.logprob import logprob_grads
from rl_kernel.backends.torch.numerics import log64
from rl_kernel.backends.triton import gemm
from rl_kernel.backends.triton.gemm import _tile_ids, _tree8
from rl_kernel.backends.triton.numerics import LAUNCH
from rl_kernel.errors import StrictModeError

VOCAB_TILE = 64
FIXED_POINT_BITS = 40
LOG2E = 1.4426950408889634
BACKWARD_TILE_ELEMENTS = 1 << 26
CHUNK_FRACTION = 10  # per-tile state of a row chunk stays under 1/10 of the LM head's bytes
MIN_CHUNK_BYTES = 1 << 25


@triton.jit
def _rint32(y):
    """Round-to-nearest-even of fp32 y >= 0 to an integer-valued fp32 (exact: adds of 2^23)."""
    return tl.where(y < 8388608.0, (y + 8388608.0) - 8388608.0, y)


@triton.jit
def _tiles_kernel(h_ptr, w_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, zt_ptr, T, V, stride_h, stride_w, k_group,
                  vocab_start, vocab_size, n_tiles,
                  GROUPS: tl.constexpr, LEAVES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, VT: tl.constexpr, FIXED: tl.constexpr,
                  LOG2E: tl.constexpr):
    pid_m, pid_n = _tile_ids(T, V, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    logits = _tree8(h_ptr, w_ptr, offs_m, offs_n, T, V, stride_h, stride_w, k_group, GROUPS, LEAVES,
                    BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    row_ok = offs_m < T
    temp = tl.load(temp_ptr + offs_m, mask=row_ok, other=1.0)
    z = tl.div_rn(logits, temp[:, None])
    real = (offs_n < V) & (vocab_start + offs_n < vocab_size)
    z = tl.where(real[None, :], z, float("-inf"))
    # target logit: the program whose columns hold it writes it (one owner per row)
    local = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1) - vocab_start
    hit = (offs_n[None, :] == local[:, None]) & real[None, :]
    z_t = tl.sum(tl.where(hit, z, 0.0), 1)
    owns = row_ok & (local >= pid_n * BLOCK_N) & (local < pid_n * BLOCK_N + BLOCK_N) & (local < V)
    tl.store(zt_ptr + offs_m, z_t, mask=owns)
    # per vocab tile of VT columns: exact max and int64 fixed-point sum of exp
    zz = tl.reshape(z, (BLOCK_M, BLOCK_N // VT, VT))
    m = tl.max(zz, 2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    e = tl.math.exp2((zz - m_use[:, :, None]) * LOG2E)
    terms = _rint32(e * FIXED).to(tl.int64)
    s = tl.sum(terms, 2)
    tiles = pid_n * (BLOCK_N // VT) + tl.arange(0, BLOCK_N // VT)
    idx = offs_m.to(tl.int64)[:, None] * n_tiles + tiles[None, :]
    mask = row_ok[:, None] & (tiles < n_tiles)[None, :]
    tl.store(m_ptr + idx, m, mask=mask)
    tl.store(s_ptr + idx, s, mask=mask)


@triton.jit
def _total_kernel(m_ptr, s_ptr, big_m_ptr, total_ptr, n_tiles, LOG2E: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    big_m = tl.load(big_m_ptr + row)
    acc = tl.zeros((BLOCK,), tl.int64)
    for j0 in range(0, n_tiles, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < n_tiles
        m = tl.load(m_ptr + row * n_tiles + j, mask=ok, other=float("-inf"))
        s = tl.load(s_ptr + row * n_tiles + j, mask=ok, other=0)
        f = tl.math.exp2((m - big_m) * LOG2E)
        y = s.to(tl.float64) * f.to(tl.float64)
        y = (y + 4503599627370496.0) - 4503599627370496.0  # rint: y < 2^52
        acc += tl.where(ok & (m != float("-inf")), y.to(tl.int64), 0)
    tl.store(total_ptr + row, tl.sum(acc, 0))


def _check(weight: torch.Tensor, vocab_start: int) -> None:
    if vocab_start % VOCAB_TILE:
        raise StrictModeError("logprobs", "triton", f"this rank's vocab slice starts at {vocab_start}, not a multiple "
                              f"of the contract's vocab tile {VOCAB_TILE}: pad the vocab so V/tp % {VOCAB_TILE} == 0")


def _forward(hidden, weight, targets, temps, vocab_start, vocab_size, group, contract_groups=None, tile=None):
    """fp32 logprobs [T] and fp64 lse [T]."""
    rows, v_local = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    x, w, precision = gemm._operands(hidden, weight)
    groups, k_group = gemm._groups(x.shape[1], None, contract_groups or gemm.CONTRACT_GROUPS)
    n_tiles = triton.cdiv(v_local, VOCAB_TILE)
    budget = max(MIN_CHUNK_BYTES, weight.numel() * weight.element_size() // CHUNK_FRACTION)
    chunk = max(1, min(rows, budget // (n_tiles * 12)))
    temps32 = temps.to(torch.float32)
    tgt = targets.to(torch.int64)
    out = torch.empty(rows, dtype=torch.float32, device=dev)
    lse_all = torch.empty(rows, dtype=torch.float64, device=dev)
    cfg = dict(tile or gemm.TILE)
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    world = dist.get_world_size(group) if group is not None else 1
    for a in range(0, rows, chunk):
        b = min(rows, a + chunk)
        r = b - a
        m_t = torch.empty(r, n_tiles, dtype=torch.float32, device=dev)
        s_t = torch.empty(r, n_tiles, dtype=torch.int64, device=dev)
        z_t = torch.zeros(r, dtype=torch.float32, device=dev)
        grid = (triton.cdiv(r, bm) * triton.cdiv(v_local, bn),)
        _tiles_kernel[grid](x[a:b], w, temps32[a:b], tgt[a:b], m_t, s_t, z_t, r, v_local, x.stride(0), w.stride(0),
                            k_group, vocab_start, vocab_size, n_tiles, GROUPS=groups, LEAVES=gemm._leaves(groups),
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=gemm.BLOCK_K, PRECISION=precision, VT=VOCAB_TILE,
                            FIXED=float(1 << FIXED_POINT_BITS), LOG2E=LOG2E, **cfg, **LAUNCH)
        big_m = m_t.amax(1)  # max is exact in any order
        if world > 1:
            dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
        total = torch.empty(r, dtype=torch.int64, device=dev)
        _total_kernel[(r,)](m_t, s_t, big_m, total, n_tiles, LOG2E=LOG2E, BLOCK=1024, num_warps=4, **LAUNCH)
        if world > 1:
            dist.all_reduce(total, group=group)  # int64: exact in any order
            dist.all_reduce(z_t, group=group)  # one owner per row: x + 0 + ... + 0 is exact
        lse = big_m.to(torch.float64) + log64(total.to(torch.float64) * (1.0 / (1 << FIXED_POINT_BITS)))
        out[a:b] = (z_t.to(torch.float64) - lse).to(torch.float32)
        lse_all[a:b] = lse
    return out, lse_all


class _TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temps, vocab_start, vocab_size, group):
        out, lse = _forward(hidden, weight, targets, temps, vocab_start, vocab_size, group)
        ctx.save_for_backward(hidden, weight, targets, temps, lse)
        ctx.vocab_start, ctx.vocab_size, ctx.group = vocab_start, vocab_size, group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, temps, lse = ctx.saved_tensors
        grad_h, grad_w = logprob_grads(grad_out, hidden, weight, targets, temps, lse, ctx.vocab_start,
                                       ctx.vocab_size, ctx.group, BACKWARD_TILE_ELEMENTS)
        return grad_h, grad_w, None, None, None, None, None


def logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
             vocab_start: int, vocab_size: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """fp32 log p(targets | hidden) [T] under the Triton logprob contract; differentiable.
    temps: fp64 [T] temperatures (> 0); weight: this rank's vocab slice starting at vocab_start."""
    _check(weight, vocab_start)
    return _TritonLogprobs.apply(hidden, weight, targets, temps, vocab_start, vocab_size, group)


def logprobs_and_lse(hidden, weight, targets, temps, vocab_start=0, vocab_size=None, group=None, *,
                     contract_groups=None, tile=None):
    """Forward only, for tests and benchmarks: (fp32 logprobs, fp64 lse). `contract_groups` and `tile`
    select another logits contract (benchmarks only)."""
    _check(weight, vocab_start)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    return _forward(hidden, weight, targets, temps, vocab_start, vocab_size, group, contract_groups, tile)
