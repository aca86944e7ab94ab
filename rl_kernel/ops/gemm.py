"""GEMM boundary: `linear`, and the row-parallel form used by tensor-parallel layers.

Strict contract (torch backend): fp32 products and accumulation; K cut into 8 equal groups, each
reduced in blocks of 64 (pairwise tree inside a block, blocks left to right), groups combined by a
pairwise tree of neighbours; bias added in fp32; the result rounded once to x's dtype.
Row-parallel: each rank reduces its own K groups; the fp32 partials are combined by the same tree
in rank order (deterministic all-reduce), then rounded once, so with tp dividing 8 the result
equals the unsharded `linear` bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl_kernel.backends.torch import gemm as torch_gemm
from rl_kernel.contracts import Contract, register
from rl_kernel.errors import StrictModeError
from rl_kernel.ops._common import check_float, is_strict, record_native, strict_contract
from rl_kernel.ops.collective import tree_all_reduce

CONTRACTS = {
    "torch": register(Contract(
        op="gemm", backend="torch", version=1,
        input_dependency="out[m, n] depends on x[m, :], weight[n, :], bias[n] only",
        partition=f"K in {torch_gemm.K_GROUPS} equal groups (1 group if K % {torch_gemm.K_GROUPS} != 0); "
                  "each group in blocks of 64, last block zero-padded",
        merge_order="pairwise tree inside a block; blocks left to right; groups by a pairwise tree of "
                    "neighbours; TP ranks (whole groups each) by the same tree in rank order",
        precision="inputs up-cast to fp32 (exact for bf16/fp16); fp32 products and accumulators",
        rounding="fp32 result (+ bias in fp32) rounded once to x's dtype",
        primitives="IEEE fp32 mul and add, no FMA",
        params=(("k_groups", torch_gemm.K_GROUPS), ("block", 64)),
    )),
    "triton": register(Contract(
        op="gemm", backend="triton", version=1,
        input_dependency="out[m, n] depends on x[m, :], weight[n, :], bias[n] only",
        partition="K in 2 equal groups (one chain if K % 8 != 0 or a TP shard holds less than a group); "
                  "each group in slices of 64 from its start, last slice zero-padded; one tile "
                  "(128 x 128, 8 warps) for every M",
        merge_order="inside a group: tensor-core dots accumulated from zero, slices left to right; the 2 groups "
                    "added; TP ranks by a pairwise tree in rank order (TP2 == TP1 bit for bit; tp 4, 8 deterministic)",
        precision="bf16/fp16 operands on tensor cores with fp32 accumulation; fp32 operands as ieee fp32 dots",
        rounding="fp32 result (+ bias in fp32) rounded once to x's dtype",
        primitives="tensor-core mma (wgmma on sm_90) with fp32 accumulators; IEEE fp32 add for the group tree",
        params=(("k_groups", 2), ("block_k", 64), ("tile", "128x128/w8")),
    )),
}


def _strict_matmul(x2d: torch.Tensor, weight: torch.Tensor, k_group: int | None = None) -> torch.Tensor:
    contract = strict_contract("gemm", x2d.device, CONTRACTS)
    check_float("gemm", contract.backend, x2d, weight)
    if contract.backend == "triton":
        from rl_kernel.backends.triton.gemm import matmul_fp32
        return matmul_fp32(x2d, weight, k_group)
    return torch_gemm.matmul_fp32(x2d, weight, k_group)


class _StrictLinear(torch.autograd.Function):
    """Forward under the contract (row-parallel when `group` is given); backward as plain fp32
    matmuls: gradients carry no bit contract. In the row-parallel form the output gradient is the
    same on every rank, so the input and weight gradients of a slice need no communication."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        x2d = x.reshape(-1, x.shape[-1])
        if group is None:
            y = _strict_matmul(x2d, weight)
        else:
            y = _row_parallel_partial(x2d, weight, group)
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(torch.float32)
        x2d = x.reshape(-1, x.shape[-1]).to(torch.float32)
        grad_x = (g @ weight.to(torch.float32)).to(x.dtype).reshape(x.shape)
        grad_w = (g.T @ x2d).to(weight.dtype)
        grad_b = g.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def _row_parallel_partial(x2d: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    k_full = x2d.shape[-1] * world
    k_group = torch_gemm.group_size(k_full)
    if x2d.shape[-1] % k_group:
        raise StrictModeError("gemm", "torch", f"a TP shard of K={x2d.shape[-1]} does not hold whole "
                              f"contract groups of {k_group} (K={k_full}, tp={world}); use tp dividing 8")
    partial = _strict_matmul(x2d, weight, k_group)
    if world == 1:
        return partial
    return tree_all_reduce(partial, group)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)`: x [..., K], weight [N, K] -> [..., N] in x's dtype."""
    if not is_strict("gemm"):
        record_native("gemm", x.device)
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return _StrictLinear.apply(x, weight, bias, None)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` in fp32, not rounded: the GEMM contract up to its final rounding (no autograd)."""
    if not is_strict("gemm"):
        record_native("gemm", x.device)
        return F.linear(x, weight.to(x.dtype)).to(torch.float32)
    return _strict_matmul(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])


def row_parallel_linear(
    x_local: torch.Tensor, weight_local: torch.Tensor, group: dist.ProcessGroup | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-parallel `linear`: x_local [..., K/tp] and weight_local [N, K/tp] are this rank's contiguous
    K slice (rank order); returns the full [..., N] on every rank, in x's dtype.

    Strict: fp32 partials over this rank's K groups, tree-reduced across ranks in rank order, bias
    added after the reduction, rounded once; with tp dividing 8 this equals `linear` on the full
    tensors bit for bit. Raises when K/tp is not a whole number of K groups.
    Native: `F.linear` on the slice, then the framework's all-reduce in x's dtype.
    """
    if not is_strict("gemm"):
        record_native("gemm", x_local.device)
        y = F.linear(x_local, weight_local.to(x_local.dtype))
        if group is not None and dist.get_world_size(group) > 1:
            record_native("all_reduce", x_local.device)
            dist.all_reduce(y, group=group)
        return y if bias is None else y + bias.to(y.dtype)
    return _StrictLinear.apply(x_local, weight_local, bias, group)
