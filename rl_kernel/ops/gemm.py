"""GEMM boundary: `linear`, and the row-parallel form used by tensor-parallel layers.

Strict contract (torch backend): fp32 products and accumulation; K cut into 8 equal groups, each
reduced in blocks of 64 (pairwise tree inside a block, blocks left to right), groups combined by a
pairwise tree of neighbours; bias added in fp32; the result rounded once to x's dtype.
Row-parallel: each rank reduces its own K groups; the fp32 partials are combined by the same tree
in rank order (deterministic all-reduce), then rounded once, so with tp dividing 8 the result
equals the unsharded `linear` bit for bit.

Strict contract (triton backend, per deployment): one fp32 chain over K for `linear` (column-parallel
and replicated linears); K in C = `rl_kernel.canonical_tp()` groups for `row_parallel_linear`, so
that any tp dividing C gives the same bits (C = 1, the same-TP layout, is one chain everywhere).

Gradients carry no bit contract: the backward runs bf16/fp16 tensor-core matmuls with fp32
accumulation on CUDA (what native training runs) and fp32 matmuls on the CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl_kernel import backends
from rl_kernel.backends.torch import gemm as torch_gemm
from rl_kernel.contracts import Contract
from rl_kernel.errors import StrictModeError
from rl_kernel.modes import canonical_tp
from rl_kernel.ops import library
from rl_kernel.ops.collective import COLLECTIVE, tree_all_reduce
from rl_kernel.ops.spec import OpSpec


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The framework's linear in x's dtype (cuBLAS / oneDNN: split-K and blocking chosen per shape)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


GEMM = OpSpec(
    "gemm",
    "gemm",
    __name__,
    native=native_linear,
    kernels={"torch": "rl_kernel.backends.torch.gemm", "triton": "rl_kernel.backends.triton.gemm"},
)
_DEPENDENCY = "out[m, n] depends on x[m, :], weight[n, :], bias[n] only"
_ROUNDING = "fp32 result (+ bias in fp32) rounded once to x's dtype"
GEMM.contract(
    "torch",
    1,
    input_dependency=_DEPENDENCY,
    rounding=_ROUNDING,
    partition=f"K in {torch_gemm.K_GROUPS} equal groups (1 group if K % {torch_gemm.K_GROUPS} != 0); "
    "each group in blocks of 64, last block zero-padded",
    merge_order="pairwise tree inside a block; blocks left to right; groups by a pairwise tree of "
    "neighbours; TP ranks (whole groups each) by the same tree in rank order",
    precision="inputs up-cast to fp32 (exact for bf16/fp16); fp32 products and accumulators",
    primitives="IEEE fp32 mul and add, no FMA",
    params=(("k_groups", torch_gemm.K_GROUPS), ("block", 64)),
)


@functools.cache
def triton_contract(c: int) -> Contract:
    """The Triton backend's GEMM contract for a deployment whose canonical TP is `c`."""
    return GEMM.contract(
        "triton",
        2,
        keep=False,
        input_dependency=_DEPENDENCY,
        rounding=_ROUNDING,
        partition=f"row-parallel linears: K in {c} equal groups (the canonical TP); every other linear: one "
        "group; a group is one chain of k16 tensor-core steps from its start",
        merge_order="inside a group: one fp32 accumulator from zero, k16 steps in ascending K (no split-K); "
        "groups by a pairwise tree of neighbours; TP ranks (whole groups each) by the same tree in "
        "rank order",
        precision="bf16/fp16 operands on tensor cores with fp32 accumulation; fp32 operands as ieee fp32 dots",
        primitives="tensor-core mma (wgmma on sm_90) with fp32 accumulators, served by cuBLASLt without split-K "
        "or by rl_kernel's Triton kernel (the same bits); IEEE fp32 add for the group tree",
        params=(("canonical_tp", c), ("k_step", 16)),
    )


GEMM.contracts["triton"] = lambda: triton_contract(canonical_tp())


def _strict_linear(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    k_group: int | None = None,
) -> torch.Tensor:
    """[M, N] under the contract: the fp32 result (+ bias in fp32) rounded once to `out_dtype`. `k_group`:
    the row-parallel group size of the full K (None: not row-parallel)."""
    contract, kernels = GEMM.strict(x2d.device, x2d, weight)
    if contract.backend == "triton":
        return kernels.linear(x2d, weight, bias, out_dtype, k_group)  # rounds in the epilogue
    y = kernels.matmul_fp32(x2d, weight, k_group)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


class _StrictLinear(torch.autograd.Function):
    """Forward under the contract (row-parallel when `row_parallel`, over `group` when given); backward
    by the fastest matmuls (no bit contract). In the row-parallel form the output gradient is the same
    on every rank, so the input and weight gradients of a slice need no communication."""

    @staticmethod
    def forward(ctx, x, weight, bias, row_parallel, group):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        x2d = x.reshape(-1, x.shape[-1])
        world = 1 if group is None else dist.get_world_size(group)
        if row_parallel and world > 1:
            y = _row_parallel_partial(x2d, weight, group, world)
            y = (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)
        else:
            k_group = (
                _row_parallel_group(x2d.shape[-1], 1, backends.strict_backend("gemm", x2d.device))
                if row_parallel
                else None
            )
            y = _strict_linear(x2d, weight, bias, x.dtype, k_group)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        # CUDA: tensor cores in the inputs' dtype, fp32 accumulation; CPU: fp32 matmuls.
        dtype = x.dtype if x.is_cuda and x.dtype == weight.dtype else torch.float32
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)
        grad_x = (g @ weight.to(dtype)).to(x.dtype).reshape(x.shape)
        grad_w = (g.T @ x2d).to(weight.dtype)
        grad_b = g.to(torch.float32).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def _row_parallel_group(k_local: int, world: int, backend: str) -> int:
    """The contract's K group size for a rank holding K/world; raises when a rank would split a group."""
    k_full = k_local * world
    if backend == "triton":
        c = canonical_tp()
        if c % world or k_full % c:
            raise StrictModeError(
                "gemm",
                backend,
                f"row-parallel over tp={world} with canonical TP {c} (K={k_full}): "
                "set rl_kernel.set_canonical_tp(C) (RL_KERNEL_CANONICAL_TP) to the largest TP "
                "of any engine of the run, a multiple of every TP and a divisor of K",
            )
        return k_full // c
    k_group = torch_gemm.group_size(k_full)
    if k_local % k_group:
        raise StrictModeError(
            "gemm",
            backend,
            f"a TP shard of K={k_local} does not hold whole "
            f"contract groups of {k_group} (K={k_full}, tp={world}); use tp dividing 8",
        )
    return k_group


def _row_parallel_partial(
    x2d: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None, world: int
) -> torch.Tensor:
    """fp32 [M, N]: this rank's K groups, then the rank-order tree all-reduce over `group` (`world` > 1 ranks)."""
    k_group = _row_parallel_group(x2d.shape[-1], world, backends.strict_backend("gemm", x2d.device))
    return tree_all_reduce(_strict_linear(x2d, weight, k_group=k_group), group)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)`: x [..., K], weight [N, K] -> [..., N] in x's dtype."""
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _linear_op(x, weight, bias)
    return GEMM(lambda *a: _StrictLinear.apply(*a, False, None), x, weight, bias)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` in fp32, not rounded: the GEMM contract up to its final rounding (no autograd)."""
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _linear_fp32_op(x, weight)
    if not GEMM.is_strict():
        GEMM.record_native(x.device)
        return native_linear(x, weight).to(torch.float32)
    return _strict_linear(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])


def row_parallel_linear(
    x_local: torch.Tensor,
    weight_local: torch.Tensor,
    group: dist.ProcessGroup | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-parallel `linear`: x_local [..., K/tp] and weight_local [N, K/tp] are this rank's contiguous
    K slice (rank order); returns the full [..., N] on every rank, in x's dtype. `group` None is tp 1
    (the unsharded reference of a row-parallel layer: it runs the row-parallel contract's groups).

    Strict: fp32 partials over this rank's K groups, tree-reduced across ranks in rank order, bias
    added after the reduction, rounded once; every tp dividing the contract's group count (8 on the
    torch backend, the canonical TP on triton) gives the bits of tp 1. Raises when a rank would split
    a K group.
    Native: `F.linear` on the slice, then the framework's all-reduce in x's dtype.
    """
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _row_parallel_linear_op(x_local, weight_local, library.register_group(group), bias)
    if not GEMM.is_strict():
        GEMM.record_native(x_local.device)
        y = native_linear(x_local, weight_local)
        if group is not None and dist.get_world_size(group) > 1:
            COLLECTIVE.record_native(x_local.device)
            dist.all_reduce(y, group=group)
        return y if bias is None else y + bias.to(y.dtype)
    return _StrictLinear.apply(x_local, weight_local, bias, True, group)


# ---- the op as one opaque node for torch.compile (rl_kernel.ops.library) ----


@torch.library.custom_op(f"{library.LIB}::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear(x, weight, bias).contiguous()


@_linear_op.register_fake
def _linear_fake(x, weight, bias):
    return library.like(x, *x.shape[:-1], weight.shape[0])


@torch.library.custom_op(f"{library.LIB}::linear_fp32", mutates_args=())
def _linear_fp32_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear_fp32(x, weight).contiguous()


@_linear_fp32_op.register_fake
def _linear_fp32_fake(x, weight):
    return library.like(x, *x.shape[:-1], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op(f"{library.LIB}::row_parallel_linear", mutates_args=())
def _row_parallel_linear_op(
    x: torch.Tensor, weight: torch.Tensor, group_key: str, bias: torch.Tensor | None
) -> torch.Tensor:
    return row_parallel_linear(x, weight, library.group_of(group_key), bias).contiguous()


@_row_parallel_linear_op.register_fake
def _row_parallel_linear_fake(x, weight, group_key, bias):
    return library.like(x, *x.shape[:-1], weight.shape[0])
