"""What rl_kernel's ops share to be opaque `torch.library` custom ops, for code that torch.compile traces
(each op file registers its own: `rl_kernel::<name>`, with its fake implementation).

While Dynamo traces (`torch.compiler.is_compiling()`), the public ops (`rk.rms_norm`, `rk.qk_norm`, `rk.rope`,
`rk.linear`, `rk.linear_fp32`, `rk.row_parallel_linear`, `rk.silu_and_mul`, `rk.attention_varlen`,
`rk.paged_attention`, `rk.moe`)
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


def group_of(key: str) -> dist.ProcessGroup | None:
    if not key:
        return None
    if key not in _GROUPS:
        raise KeyError(f"rl_kernel custom op: process group {key!r} was never registered (register_group)")
    return _GROUPS[key]


def like(x: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty(shape or x.shape, dtype=dtype or x.dtype)


OPS = (
    "rms_norm",
    "rms_norm_residual",
    "qk_norm",
    "rope",
    "qk_norm_rope",
    "linear",
    "linear_fp32",
    "row_parallel_linear",
    "silu_and_mul",
    "attention_varlen",
    "paged_attention",
    "moe",
)  # torch.ops.rl_kernel.<name>
