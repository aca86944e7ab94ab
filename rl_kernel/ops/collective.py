"""Collective boundary: a deterministic all-reduce over a process group.

Strict contract: every rank gathers every rank's tensor (all_gather moves bits, it adds nothing),
then sums them by a pairwise tree of neighbours in rank order, in the tensor's dtype. Every rank
therefore holds the same bits, and the result does not depend on the transport's reduction order
(NCCL rings and trees, gloo's algorithms). For fp32 partials of the GEMM contract, the tree is the
top of the GEMM's own group tree.

The gather has two transports with one result: torch.distributed's `all_gather_into_tensor` over the group
(gloo on CPU; the default), or a device communicator registered for the group (`use_gather`: vLLM's
`GroupCoordinator.all_gather(x, dim=0)`, NCCL on CUDA through vLLM's own communicator, which CUDA graphs can
capture; vLLM's shared-memory all-gather on CPU). Either way the tree sum that follows is the same kernel
sequence on the same device, so the bits do not depend on which one moved the partials.
"""

from __future__ import annotations

from collections.abc import Callable

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


Gather = Callable[[torch.Tensor], torch.Tensor]  # x [1, n] -> [world, n], rank order (a bit copy)
_GATHERS: dict[int, tuple[dist.ProcessGroup, Gather]] = {}
GATHERS_RUN = {"device": 0, "torch.distributed": 0}  # eager gathers per transport in this process (tests read it)


def use_gather(group: dist.ProcessGroup, gather: Gather | None) -> None:
    """Route the strict collectives' all-gathers over `group` through `gather` (a device communicator's
    concatenating all-gather along dim 0, e.g. `lambda t: vllm_group.all_gather(t, dim=0)`); None restores
    torch.distributed's."""
    if gather is None:
        _GATHERS.pop(id(group), None)
    else:
        _GATHERS[id(group)] = (group, gather)


def gather_ranks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `x`, stacked in rank order: [world, *x.shape] (a bit copy), over `group`'s registered
    device gather (`use_gather`) or torch.distributed's."""
    world = dist.get_world_size(group)
    flat = x.contiguous().view(1, -1)
    registered = _GATHERS.get(id(group))
    if registered is not None:
        GATHERS_RUN["device"] += 1
        out = registered[1](flat)
    else:
        GATHERS_RUN["torch.distributed"] += 1
        out = torch.empty(world, flat.shape[1], dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, flat, group=group)
    return out.view(world, *x.shape)


def tree_sum_ranks(parts: torch.Tensor) -> torch.Tensor:
    """The strict merge of gathered partials [world, ...]: a pairwise tree of neighbours over the rank dim
    (rank 2i + rank 2i+1, ...: tree_sum's order), in the partials' dtype."""
    while parts.shape[0] > 1:
        if parts.shape[0] % 2:
            parts = torch.cat([parts, torch.zeros_like(parts[:1])])
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def tree_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The strict reduction (no mode check): gather, then tree-sum in rank order. It is the same
    torch code whatever backend the other ops use, so it is recorded under its one contract."""
    evidence.record(CONTRACT, "strict", x.device.type)
    return tree_sum_ranks(gather_ranks(x, group))


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of `x` over the ranks of `group`; returns a new tensor, same on every rank.

    Strict: gather then tree in rank order (see module docstring). Native: `dist.all_reduce`.
    """
    return COLLECTIVE(tree_all_reduce, x, group)
