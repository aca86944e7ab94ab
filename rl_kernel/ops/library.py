"""rl_kernel's ops as opaque `torch.library` custom ops, for code that torch.compile traces.

While Dynamo traces (`torch.compiler.is_compiling()`), the public ops (`rk.rms_norm`, `rk.rope`, `rk.linear`,
`rk.linear_fp32`, `rk.row_parallel_linear`, `rk.silu_and_mul`, `rk.attention_varlen`, `rk.paged_attention`)
put one `torch.ops.rl_kernel.*` node into the graph instead of their Python body. Inductor does not look inside
a custom op, so it neither fuses, reorders nor rewrites what the op computes; when the compiled graph runs, the
node calls the public op eagerly (mode dispatch, contract, evidence, as without compile). A compiled forward
therefore gives the eager forward's bits where what lies between the ops is exact (views, slices, gathers,
copies). The fake implementations state each output's shape, dtype and contiguous strides; the real outputs are
made contiguous to match (a copy where one is not, no bit changes). Eager calls skip the dispatcher entirely.
No autograd formulas: compiled code runs forwards (rollout); training calls the ops eagerly.

A row-parallel linear's process group is not an operator argument: `group_key` names it here (`register_group`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LIB = "rl_kernel"
_GROUPS: dict[str, dist.ProcessGroup] = {}


def register_group(group: dist.ProcessGroup | None) -> str:
    """The key under which the custom ops find `group` ("" for None: tp 1)."""
    if group is None:
        return ""
    key = group.group_name
    _GROUPS[key] = group
    return key


def _group(key: str) -> dist.ProcessGroup | None:
    if not key:
        return None
    if key not in _GROUPS:
        raise KeyError(f"rl_kernel custom op: process group {key!r} was never registered (register_group)")
    return _GROUPS[key]


def _like(x: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty(shape or x.shape, dtype=dtype or x.dtype)


@torch.library.custom_op(f"{LIB}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from rl_kernel.ops.norm import rms_norm as op

    return op(x, weight, eps).contiguous()


@rms_norm.register_fake
def _(x, weight, eps):
    return _like(x)


@torch.library.custom_op(f"{LIB}::rms_norm_residual", mutates_args=())
def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from rl_kernel.ops.norm import rms_norm as op

    y, s = op(x, weight, eps, residual=residual)
    return y.contiguous(), s.contiguous()


@rms_norm_residual.register_fake
def _(x, residual, weight, eps):
    return _like(x), _like(x)


@torch.library.custom_op(f"{LIB}::rope", mutates_args=())
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None) -> torch.Tensor:
    from rl_kernel.ops.rope import rope as op

    return op(x, positions, theta, rotary_dim).contiguous()


@rope.register_fake
def _(x, positions, theta, rotary_dim):
    return _like(x)


@torch.library.custom_op(f"{LIB}::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from rl_kernel.ops.gemm import linear as op

    return op(x, weight, bias).contiguous()


@linear.register_fake
def _(x, weight, bias):
    return _like(x, *x.shape[:-1], weight.shape[0])


@torch.library.custom_op(f"{LIB}::linear_fp32", mutates_args=())
def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from rl_kernel.ops.gemm import linear_fp32 as op

    return op(x, weight).contiguous()


@linear_fp32.register_fake
def _(x, weight):
    return _like(x, *x.shape[:-1], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::row_parallel_linear", mutates_args=())
def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group_key: str,
                        bias: torch.Tensor | None) -> torch.Tensor:
    from rl_kernel.ops.gemm import row_parallel_linear as op

    return op(x, weight, _group(group_key), bias).contiguous()


@row_parallel_linear.register_fake
def _(x, weight, group_key, bias):
    return _like(x, *x.shape[:-1], weight.shape[0])


@torch.library.custom_op(f"{LIB}::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from rl_kernel.ops.activation import silu_and_mul as op

    return op(x).contiguous()


@silu_and_mul.register_fake
def _(x):
    return _like(x, *x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op(f"{LIB}::attention_varlen", mutates_args=())
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     max_seqlen: int | None) -> torch.Tensor:
    from rl_kernel.ops.attention import attention_varlen as op

    return op(q, k, v, cu_seqlens, scale, max_seqlen).contiguous()


@attention_varlen.register_fake
def _(q, k, v, cu_seqlens, scale, max_seqlen):
    return _like(q)


@torch.library.custom_op(f"{LIB}::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    from rl_kernel.ops.attention import paged_attention as op

    return op(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale).contiguous()


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale):
    return _like(q)


OPS = ("rms_norm", "rms_norm_residual", "rope", "linear", "linear_fp32", "row_parallel_linear", "silu_and_mul",
       "attention_varlen", "paged_attention")  # torch.ops.rl_kernel.<name>
