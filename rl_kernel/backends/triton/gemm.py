"""Strict GEMM on the GPU: out[m, n] = sum_k x[m, k] w[n, k] in fp32 with a fixed schedule.

Contract (triton v2). The local K is cut into groups of `k_group` elements (one group when none is
given). A group's partial is one fp32 accumulator chained through the tensor cores' k16 steps in
ascending K from zero: what cuBLASLt computes without split-K, and what this file's Triton kernel
computes with any tile (wgmma accumulates each output element independently of the tile shape).
Group partials are combined by a pairwise tree of neighbours. Only row-parallel linears have more
than one group: K in C = canonical_tp groups of the full K, so a rank of any TP dividing C holds
whole groups and its partial is an exact subtree (see rl_kernel.ops.gemm). Every other linear is
one chain.

Two servers, the same bits (tests/gpu/test_triton_kernels.py asserts it for Qwen3-8B shapes):
cuBLASLt when `cublaslt_ready()` (its workspace claimed so that no split-K kernel can be chosen; bf16
reduced-precision reduction off) for every one-chain product and for K-grouped ones from LT_MIN_M rows,
and the Triton kernel otherwise (one tile per
M size class; a tile's shape moves no bit, which the same tests check against cuBLASLt). bf16/fp16
operands use tensor cores; fp32 operands use ieee fp32 dots, on the Triton kernel only. Two Triton
schedules compute the same IEEE operations: `fused` keeps the group tree in registers; `split` runs
one program per group (more parallelism when M is small), stores the exact fp32 partials and adds
them by the same tree in a second kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton import cublaslt_ready
from rl_kernel.backends.triton.numerics import LAUNCH, tree_sum

BLOCK_K = 64
# One Triton tile configuration for every M. 4 stages: 9-23% faster than 3 on an H200, identical bits.
TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4}
# Decode-sized M: narrow tiles give more programs to stream the weights (a tile's shape moves no bit).
SMALL_M = 64
# Picked by benchmarks/kernels.py's tile sweep on an H200 (o and down at M = 1, 16, 128; kernels_h200.json).
SMALL_TILE = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
MID_TILE = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
WIDE_N = 16384  # from here on a narrow N tile already gives enough programs (gate_up): shorter K steps win
WIDE_SMALL_TILE = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 5}
SPLIT_MAX_M = 64  # rows up to which the Triton split schedule is used (no effect on any bit)
MID_MAX_M = 255  # rows up to which the Triton kernel uses the mid-size tile
# Rows from which cuBLASLt serves a K-grouped (row-parallel) product: one cuBLASLt call per group plus the
# tree, against the Triton split schedule's two launches. One-chain products go to cuBLASLt at any M: on an
# H200 it ran 0.99-1.09x default cuBLAS at M = 1, 16, 128 where the Triton kernel ran 0.66-0.96x, with equal
# bits (kernels_h200.json; tests/gpu/test_triton_kernels.py checks every M from 1 to 256). No effect on any bit.
LT_MIN_M = 256
SERVERS = ("auto", "triton", "cublaslt")


def groups_of(k: int, k_group: int | None) -> tuple[int, int]:
    """(number of groups, group size) over a local K: one chain unless `k_group` cuts K into whole groups."""
    if k_group is None or k_group >= k:
        return 1, k
    if k % k_group:
        raise ValueError(f"K={k} is not a whole number of contract groups of {k_group}")
    groups = k // k_group
    if groups & (groups - 1) or groups > 8:
        raise ValueError(f"{groups} contract groups over K={k}: the group tree takes a power of two <= 8")
    return groups, k_group


@contextlib.contextmanager
def cublaslt() -> Iterator[None]:
    """cuBLASLt for the calls inside, with no reduced-precision split-K reduction; restores the settings."""
    matmul = torch.backends.cuda.matmul
    saved = (
        torch.backends.cuda.preferred_blas_library(),
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
    torch.backends.cuda.preferred_blas_library("cublaslt")
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved[0])
        matmul.allow_bf16_reduced_precision_reduction = saved[1]
        matmul.allow_fp16_reduced_precision_reduction = saved[2]


def use_cublaslt(x: torch.Tensor, weight: torch.Tensor, server: str | None = None, groups: int = 1) -> bool:
    """Whether cuBLASLt serves this product of `groups` contract groups (never for fp32 operands or off CUDA)."""
    server = server or "auto"
    if server not in SERVERS:
        raise ValueError(f"unknown GEMM server {server!r}; choose one of {SERVERS}")
    eligible = x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and cublaslt_ready()
    if server == "cublaslt" and not eligible:
        raise RuntimeError(
            "cuBLASLt cannot serve this GEMM contract here (16-bit CUDA operands and a claimed "
            "workspace are needed; see rl_kernel.backends.triton)"
        )
    return eligible and (server == "cublaslt" or (server == "auto" and (groups == 1 or x.shape[0] >= LT_MIN_M)))


def tree_add(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise tree of neighbours over a power-of-two list of fp32 tensors: ((p0 + p1) + (p2 + p3)) ..."""
    while len(parts) > 1:
        parts = [a + b for a, b in zip(parts[0::2], parts[1::2])]
    return parts[0]


def _lt_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, groups: int, k_group: int
) -> torch.Tensor:
    with cublaslt():
        if groups == 1 and bias is None and out_dtype == x.dtype:
            return x @ weight.t()  # the epilogue rounds the fp32 chain once, as the Triton kernel does
        parts = [
            torch.mm(
                x[:, g * k_group : (g + 1) * k_group],
                weight[:, g * k_group : (g + 1) * k_group].t(),
                out_dtype=torch.float32,
            )
            for g in range(groups)
        ]
    acc = tree_add(parts)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)


@triton.jit
def _group_dot(
    x_ptr,
    w_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_xm,
    stride_wn,
    k_start,
    k_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] partial of K slice [k_start, k_start + k_len): dots from zero, left to right."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[None, :] < N
    # row bases in int64 once (M x K passes 2^31 at 175k tokens of K = 12288); the K offsets stay int32
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    for k0 in range(0, k_len, BLOCK_K):
        k_ok = (k0 + offs_k) < k_len
        kk = k_start + k0 + offs_k
        a = tl.load(x_rows + kk[None, :], mask=m_ok & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + kk[:, None], mask=n_ok & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grouped launch order (8 row tiles share column tiles) for L2 reuse; it moves no bit.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = 8 * tiles_n
    first_m = (pid // width) * 8
    size_m = tl.minimum(tiles_m - first_m, 8)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _tree8(
    x_ptr,
    w_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_xm,
    stride_wn,
    k_group,
    GROUPS: tl.constexpr,
    LEAVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The group tree in registers, ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7)), leaves past GROUPS zero.

    One runtime loop over the groups (one copy of the pipelined K loop, so one set of pointers); at the
    end of group g its partial is folded into the held subtrees like a binary counter."""
    zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    l0, l1, l2 = zero, zero, zero  # held leaf, pair, quad
    for g in range(0, LEAVES):
        acc = _group_dot(
            x_ptr,
            w_ptr,
            offs_m,
            offs_n,
            M,
            N,
            stride_xm,
            stride_wn,
            g * k_group,
            tl.where(g < GROUPS, k_group, 0),
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
        )
        if g % 2 == 0:
            l0 = acc
        else:
            v = l0 + acc
            if (g // 2) % 2 == 0:
                l1 = v
            else:
                v = l1 + v
                if (g // 4) % 2 == 0:
                    l2 = v
                else:
                    l2 = l2 + v
    if LEAVES == 1:
        out = l0
    elif LEAVES == 2:
        out = l1
    else:
        out = l2
    return out


@triton.jit(do_not_specialize=["M"])  # one compile per tile class, not per row count
def _fused_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    k_group,
    HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,
    LEAVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tree8(
        x_ptr,
        w_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_xm,
        stride_wn,
        k_group,
        GROUPS,
        LEAVES,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
    )
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit(do_not_specialize=["M"])
def _split_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    k_group,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    acc = _group_dot(
        x_ptr,
        w_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_xm,
        stride_wn,
        g * k_group,
        k_group,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        PRECISION,
    )
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows = g.to(tl.int64) * M + offs_m  # partials [groups, M, N]: int64 before the products with N
    tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _tree_kernel(
    part_ptr,
    out_ptr,
    bias_ptr,
    numel,
    N,
    HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,
    LEAVES: tl.constexpr,
    LOG2_LEAVES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # numel = M x N may pass 2^31
    mask = offs < numel
    p = tl.load(
        part_ptr + offs[None, :] + tl.arange(0, LEAVES).to(tl.int64)[:, None] * numel,
        mask=mask[None, :] & (tl.arange(0, LEAVES)[:, None] < GROUPS),
        other=0.0,
    )
    acc = tree_sum(tl.trans(p), LOG2_LEAVES)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tile_for(m: int, n: int) -> dict:
    """The Triton tile for an [M, N] output (a size class; no bit depends on it)."""
    if n >= WIDE_N:
        return WIDE_SMALL_TILE if m <= SMALL_M else TILE
    return SMALL_TILE if m <= SMALL_M else MID_TILE if m <= MID_MAX_M else TILE


def _leaves(groups: int) -> int:
    return 1 << max(groups - 1, 0).bit_length()


def _operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    if x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return x.contiguous(), weight.contiguous(), "tf32"  # precision argument unused for 16-bit dots
    return x.to(torch.float32).contiguous(), weight.to(torch.float32).contiguous(), "ieee"


def matmul_fp32(
    x: torch.Tensor,
    weight: torch.Tensor,
    k_group: int | None = None,
    *,
    schedule: str | None = None,
    tile: dict | None = None,
    server: str | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> fp32 [M, N], unrounded, under the GEMM contract.

    `k_group` cuts the local K into contract groups (row-parallel linears); None is one chain.
    `schedule` ('fused' or 'split'), `tile` and `server` ('triton', 'cublaslt') are for tests and
    benchmarks: none of them changes a bit."""
    return linear(x, weight, None, torch.float32, k_group, schedule=schedule, tile=tile, server=server)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    k_group: int | None = None,
    *,
    schedule: str | None = None,
    tile: dict | None = None,
    server: str | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias, in fp32) rounded once to `out_dtype` (x's dtype by default):
    the bits of `matmul_fp32(x, weight) + bias.float()` rounded, in one pass on the Triton server."""
    m, k = x.shape
    n = weight.shape[0]
    groups, k_group = groups_of(k, k_group)
    out_dtype = out_dtype or x.dtype
    if m and n and schedule is None and tile is None and use_cublaslt(x, weight, server, groups):
        return _lt_linear(x, weight, bias, out_dtype, groups, k_group)
    x, weight, precision = _operands(x, weight)
    cfg = dict(tile or tile_for(m, n))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K", BLOCK_K)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    bias_arg = out if bias is None else bias.contiguous()
    if m == 0 or n == 0:
        return out
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    schedule = schedule or ("split" if m <= SPLIT_MAX_M and groups > 1 else "fused")
    if schedule == "fused":
        _fused_kernel[(tiles,)](
            x,
            weight,
            out,
            bias_arg,
            m,
            n,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            k_group,
            HAS_BIAS=bias is not None,
            GROUPS=groups,
            LEAVES=_leaves(groups),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            PRECISION=precision,
            **cfg,
            **LAUNCH,
        )
        return out
    part = torch.empty(groups, m, n, dtype=torch.float32, device=x.device)
    _split_kernel[(tiles, groups)](
        x,
        weight,
        part,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        k_group,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PRECISION=precision,
        **cfg,
        **LAUNCH,
    )
    block = 1024
    _tree_kernel[(triton.cdiv(m * n, block),)](
        part,
        out,
        bias_arg,
        m * n,
        n,
        HAS_BIAS=bias is not None,
        GROUPS=groups,
        LEAVES=_leaves(groups),
        LOG2_LEAVES=_leaves(groups).bit_length() - 1,
        BLOCK=block,
        num_warps=4,
        **LAUNCH,
    )
    return out
