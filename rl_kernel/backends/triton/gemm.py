"""Strict GEMM on Triton: out[m, n] = sum_k x[m, k] w[n, k] in fp32 with a fixed schedule.

Contract (triton v1): K is cut into CONTRACT_GROUPS = 2 equal halves (one chain when K % 8 != 0).
A group's partial is a chain of tensor-core dots over BLOCK_K = 64 slices of K from the group's
start, accumulated in fp32 from zero (the last slice zero-padded). Group partials are combined by
a pairwise tree of neighbours, so a tensor-parallel shard holding whole groups (tp = 2) computes an
exact subtree of the unsharded sum: TP2 == TP1 bit for bit. A shard smaller than a group (tp = 4, 8)
is one chain over its slice: the same tp on both sides still gives the same bits, TP1 does not.

Why 2 groups and not the torch contract's 8: the tree needs log2(groups) + 1 fp32 tiles live in
registers. With 8 groups only a 128 x 64 tile fits (230 registers, no spill), which is L2-bandwidth
bound on an H200; 2 groups fit a 128 x 128 tile (187 registers). `contract_groups` selects 8, 4 or 1
for benchmarks (other contracts; see docs/triton.md).

One tile shape (TILE below) is used for every M: the tensor-core instruction and its K order are
the same for every output element. Two schedules compute the same IEEE operations: `fused` keeps
the group tree in registers; `split` runs one program per group (more parallelism when M is
small), stores the exact fp32 partials and adds them by the same tree in a second kernel. fp32
inputs use fp32 ("ieee") dots; bf16/fp16 inputs use the tensor cores' native dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_kernel.backends.triton.numerics import LAUNCH, tree_sum

K_GROUPS = 8  # the torch contract's groups: callers pass k_group = K / K_GROUPS of the full K
CONTRACT_GROUPS = 2  # this contract's groups of the full K (each K_GROUPS / CONTRACT_GROUPS torch groups)
BLOCK_K = 64
# The one tile configuration (per-element bits depend on it: changing it is a new contract version).
TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
SPLIT_MAX_M = 64  # rows up to which the split schedule is used (no effect on any bit)


def group_size(k: int) -> int:
    """The torch contract's group size for a full reduction of length k (what callers pass as k_group)."""
    return k // K_GROUPS if k % K_GROUPS == 0 else k


def _groups(k: int, k_group: int | None, contract_groups: int) -> tuple[int, int]:
    """(number of groups, group size) of this contract over a local K. A local K that holds whole groups of
    the full K's contract grouping is cut into them; anything else (K % 8 != 0, or a TP shard smaller than
    one group) is one chain over the local K."""
    unit = (group_size(k) if k_group is None else k_group) * (K_GROUPS // contract_groups)
    if k >= unit and k % unit == 0 and k // unit > 1:
        return k // unit, unit
    return 1, k


@triton.jit
def _group_dot(x_ptr, w_ptr, offs_m, offs_n, M, N, stride_xm, stride_wn, k_start, k_len,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] partial of K slice [k_start, k_start + k_len): dots from zero, left to right."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[None, :] < N
    for k0 in range(0, k_len, BLOCK_K):
        k_ok = (k0 + offs_k) < k_len
        kk = k_start + k0 + offs_k
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None], mask=n_ok & k_ok[:, None], other=0.0)
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
def _tree8(x_ptr, w_ptr, offs_m, offs_n, M, N, stride_xm, stride_wn, k_group, GROUPS: tl.constexpr,
           LEAVES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           PRECISION: tl.constexpr):
    """The group tree in registers, ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7)), leaves past GROUPS zero.

    One runtime loop over the groups (one copy of the pipelined K loop, so one set of pointers); at the
    end of group g its partial is folded into the held subtrees like a binary counter."""
    zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    l0, l1, l2 = zero, zero, zero  # held leaf, pair, quad
    for g in range(0, LEAVES):
        acc = _group_dot(x_ptr, w_ptr, offs_m, offs_n, M, N, stride_xm, stride_wn, g * k_group,
                         tl.where(g < GROUPS, k_group, 0), BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
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


@triton.jit
def _fused_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, M, N, stride_xm, stride_wn, stride_om, k_group,
                  HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, LEAVES: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tree8(x_ptr, w_ptr, offs_m, offs_n, M, N, stride_xm, stride_wn, k_group, GROUPS, LEAVES,
                 BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_kernel(x_ptr, w_ptr, part_ptr, M, N, stride_xm, stride_wn, k_group,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    acc = _group_dot(x_ptr, w_ptr, offs_m, offs_n, M, N, stride_xm, stride_wn, g * k_group, k_group,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(part_ptr + g * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _tree_kernel(part_ptr, out_ptr, bias_ptr, numel, N, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr,
                 LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(part_ptr + offs[None, :] + tl.arange(0, LEAVES)[:, None] * numel,
                mask=mask[None, :] & (tl.arange(0, LEAVES)[:, None] < GROUPS), other=0.0)
    acc = tree_sum(tl.trans(p), LOG2_LEAVES)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _leaves(groups: int) -> int:
    return 1 << max(groups - 1, 0).bit_length()


def _operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    if x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return x.contiguous(), weight.contiguous(), "tf32"  # precision argument unused for 16-bit dots
    return x.to(torch.float32).contiguous(), weight.to(torch.float32).contiguous(), "ieee"


def matmul_fp32(x: torch.Tensor, weight: torch.Tensor, k_group: int | None = None, *,
                schedule: str | None = None, tile: dict | None = None, contract_groups: int | None = None,
                ) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> fp32 [M, N], unrounded, under the Triton GEMM contract.

    `k_group` is the torch contract's group size of the full (unsharded) K, as the dispatch passes it.
    `schedule` ('fused' or 'split'), `tile` and `contract_groups` are for tests and benchmarks only:
    the schedule never changes a bit; another tile or group count is another contract."""
    return linear(x, weight, None, torch.float32, k_group, schedule=schedule, tile=tile,
                  contract_groups=contract_groups)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, k_group: int | None = None, *,
           schedule: str | None = None, tile: dict | None = None, contract_groups: int | None = None,
           ) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias, in fp32) rounded once to `out_dtype` (x's dtype by default) in
    the kernel's epilogue: the bits of `matmul_fp32(x, weight) + bias.float()` rounded, in one pass."""
    m, k = x.shape
    n = weight.shape[0]
    if k_group is not None and k % k_group:
        raise ValueError(f"K={k} is not a whole number of contract groups of {k_group}")
    groups, k_group = _groups(k, k_group, contract_groups or CONTRACT_GROUPS)
    out_dtype = out_dtype or x.dtype
    x, weight, precision = _operands(x, weight)
    cfg = dict(TILE if tile is None else tile)
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    bias_arg = out if bias is None else bias.contiguous()
    if m == 0 or n == 0:
        return out
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    schedule = schedule or ("split" if m <= SPLIT_MAX_M and groups > 1 else "fused")
    if schedule == "fused":
        _fused_kernel[(tiles,)](x, weight, out, bias_arg, m, n, x.stride(0), weight.stride(0), out.stride(0), k_group,
                                HAS_BIAS=bias is not None, GROUPS=groups, LEAVES=_leaves(groups), BLOCK_M=bm,
                                BLOCK_N=bn, BLOCK_K=BLOCK_K, PRECISION=precision, **cfg, **LAUNCH)
        return out
    part = torch.empty(groups, m, n, dtype=torch.float32, device=x.device)
    _split_kernel[(tiles, groups)](x, weight, part, m, n, x.stride(0), weight.stride(0), k_group,
                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, PRECISION=precision, **cfg, **LAUNCH)
    block = 1024
    _tree_kernel[(triton.cdiv(m * n, block),)](part, out, bias_arg, m * n, n, HAS_BIAS=bias is not None,
                                               GROUPS=groups, LEAVES=_leaves(groups),
                                               LOG2_LEAVES=_leaves(groups).bit_length() - 1, BLOCK=block,
                                               num_warps=4, **LAUNCH)
    return out
