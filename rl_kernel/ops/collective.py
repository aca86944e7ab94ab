"""Collective boundary: a deterministic all-reduce over a process group.

Strict contract: every rank gathers every rank's tensor (all_gather moves bits, it adds nothing),
then sums them by a pairwise tree of neighbours in rank order, in the tensor's dtype. Every rank
therefore holds the same bits, and the result does not depend on the transport's reduction order
(NCCL rings and trees, gloo's algorithms). For fp32 partials of the GEMM contract, the tree is the
top of the GEMM's own group tree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_kernel import evidence
from rl_kernel.ops.spec import OpSpec


def native_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The transport's all-reduce (NCCL rings and trees, gloo's algorithms) on a copy of x."""
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y


# The same torch code on every backend (gloo on CPU, NCCL on CUDA): one contract, one kernel module (this one).
COLLECTIVE = OpSpec("all_reduce", "collective", __name__, kernels={"torch": __name__}, native=native_all_reduce)
CONTRACT = COLLECTIVE.contract(
    "torch",
    1,
    input_dependency="out depends on the same element of every rank's input",
    partition="one partial per rank",
    merge_order="all_gather, then a pairwise tree of neighbours in rank order (rank 2i + rank 2i+1, ...)",
    precision="the input dtype throughout",
    rounding="one rounding per tree addition, in the input dtype",
    primitives="IEEE add; all_gather is a bit copy",
)


def tree_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The strict reduction (no mode check): gather, then tree-sum in rank order. It is the same
    torch code whatever backend the other ops use, so it is recorded under its one contract."""
    evidence.record(CONTRACT, "strict", x.device.type)
    world = dist.get_world_size(group)
    flat = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, x.contiguous().view(-1), group=group)
    parts = flat.view(world, *x.shape)
    while parts.shape[0] > 1:  # pairwise tree of neighbours over the rank dim (tree_sum's order)
        if parts.shape[0] % 2:
            parts = torch.cat([parts, torch.zeros_like(parts[:1])])
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of `x` over the ranks of `group`; returns a new tensor, same on every rank.

    Strict: gather then tree in rank order (see module docstring). Native: `dist.all_reduce`.
    """
    return COLLECTIVE(tree_all_reduce, x, group)
