"""Expert parallelism for the MoE boundary: a Qwen3-MoE sparse block whose experts are split over the ranks
of a process group, with every token's route and output bits those of the one-rank block (`rk.moe`).

Layout: the group's W ranks each hold their own tokens x [T_r, D] (any T_r, zero too), the whole router weight
[E, D] and the contiguous expert slice [r * E / W, (r + 1) * E / W) (Megatron's expert-parallel layout:
`gate_up` [E / W, 2I, D], `down` [E / W, D, I]).

Contract (strict, every rank of the group in strict mode):
1. route: each rank routes its own tokens by `moe_route` (the router contract: a token's ids and weights are
   functions of that token alone, so they are the one-rank block's);
2. dispatch: every (token, slot) row is sent to the rank owning its expert by one all-to-all of the rows
   (split sizes exchanged first by an all-to-all of per-rank counts); a row keeps its bits (a copy);
3. experts: each rank runs `moe_experts` (the grouped expert contract: a row's fp32 output depends on the row and
   its expert's weights only, not on the rows beside it nor their number) on the rows it received;
4. return: the fp32 rows go back to their tokens' ranks by the reverse all-to-all (a copy) into [T_r, k, D];
5. combine: `moe_combine` on the token's home rank: its k slots summed in ascending expert id in fp32 from the
   first product, rounded once to x's dtype (the combine contract, unchanged).
So a token's (output, ids) bits at any W equal the one-rank block's. Nothing is summed across ranks.

Why all-to-all, not all-gather: each rank sends only the rows its peers' experts need (T_r * k * D values in all)
instead of every rank receiving every token (W * T * D), and the receiving rank computes only its own experts'
rows; the bits are the same either way because dispatch only copies. The split sizes are read on the host
(an eager path: the trainer's; not capturable by a CUDA graph).

Native form (the moe boundary native): the ops' native forms (HF's router, per-expert F.linear), and the
framework's combine over ranks (the DeepEP / Megatron-style local reduction): each owning rank sums a token's
slots it holds in x's dtype (HF's combine on its slots), the partials return in x's dtype and the home rank sums
them in rank order in x's dtype. Its bits move with W (another association and more roundings).

Autograd: the all-to-alls are differentiable (the backward is the reverse all-to-all), so gradients flow to x,
the router weight (this rank's tokens only: the data-parallel all-reduce sums them) and this rank's experts
(every rank's rows routed to them). Gradients carry no bit contract (as the MoE ops').
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_kernel.ops.moe import COMBINE, check_top_k, moe_combine, moe_experts, moe_route, native_combine


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with split sizes; its backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows of x [sum(send), ...] sent in rank order (send[r] rows to rank r); returns the [sum(recv), ...] rows
    received, rank order (a bit copy, differentiable)."""
    return _AllToAll.apply(x, send, recv, group)


def check_expert_slices(num_experts: int, local_experts: int, world: int) -> None:
    """ValueError unless the router's experts are the group's slices put together (E == E_local * W)."""
    if num_experts != local_experts * world:
        raise ValueError(
            f"expert parallelism: the router has {num_experts} experts but {world} ranks hold {local_experts} each; "
            f"give each rank num_experts / ep = {num_experts / world:g} experts (num_experts divisible by ep)"
        )


def _counts(owner: torch.Tensor, world: int, group) -> tuple[list[int], list[int]]:
    send = torch.bincount(owner, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return send.tolist(), recv.tolist()


def _token_counts(t: int, world: int, group, device: torch.device) -> list[int]:
    """Every rank's token count, rank order."""
    out = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, torch.tensor([t], dtype=torch.int64, device=device), group=group)
    return out.tolist()


def _dispatch(x, ids, local, world, group):
    """(received rows, their local expert ids, send / recv split sizes, the order that sorted the sent rows)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    owner = torch.div(flat, local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)  # (token, slot) rows by destination rank
    send, recv = _counts(owner, world, group)
    rows = all_to_all_rows(x[order // k], send, recv, group)
    expert = all_to_all_rows((flat[order] - owner[order] * local).unsqueeze(-1), send, recv, group)
    return rows, expert, send, recv, order


def _expert_rows(rows, expert, gate_up, down):
    return moe_experts(rows, expert, gate_up, down).squeeze(1)  # fp32 [R, D]: one slot per received row


def moe_expert_parallel(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse block on this rank's tokens x [T, D] with the experts split over `group` (None: the default
    group): (output [T, D] in x's dtype, int64 expert ids [T, k] ascending), the bits of
    `rk.moe(x, router_weight, full gate_up, full down, top_k, renormalize)` in strict mode. router_weight
    [E, D] (every rank the same), gate_up [E / W, 2I, D] and down [E / W, D, I] this rank's experts
    (rank r: experts r * E / W ...). Every rank of the group must call it (a collective), in one mode."""
    world = dist.get_world_size(group)
    local = gate_up.shape[0]
    check_expert_slices(router_weight.shape[0], local, world)
    check_top_k(top_k, router_weight.shape[0])
    x2d = x.reshape(-1, x.shape[-1])
    weights, ids = moe_route(x2d, router_weight, top_k, renormalize)
    t, k = ids.shape
    rows, expert, send, recv, order = _dispatch(x2d, ids, local, world, group)
    y = _expert_rows(rows, expert, gate_up, down)
    if not COMBINE.is_strict():
        COMBINE.record_native(x.device)
        return _native_combine(y, weights, order, send, recv, t, k, x2d.dtype, group).reshape(x.shape), ids
    back = all_to_all_rows(y, recv, send, group)  # fp32 rows, in the order they were sent
    y_tokens = torch.empty_like(back).index_copy(0, order, back).reshape(t, k, y.shape[-1])
    return moe_combine(y_tokens, weights, ids, x2d.dtype).reshape(x.shape), ids


def _native_combine(y, weights, order, send, recv, t, k, dtype, group) -> torch.Tensor:
    """The framework's expert-parallel combine: a per-token partial on each owning rank (its slots, in
    `dtype`), the partials back in `dtype` and summed in rank order in `dtype`."""
    world = len(send)
    # each received row's token (on its source rank) and weight travel with it
    token = all_to_all_rows((order // k).unsqueeze(-1), send, recv, group).squeeze(-1)
    w = all_to_all_rows(weights.reshape(-1)[order].unsqueeze(-1), send, recv, group)
    weighted = native_combine(y.unsqueeze(1), w, dtype)  # [R, D] in dtype: HF's product per slot
    # per source rank, per token of that rank: the sum of its slots here (scatter-add in dtype)
    source = torch.repeat_interleave(torch.arange(world, device=y.device), torch.tensor(recv, device=y.device))
    tokens_of = _token_counts(t, world, group, y.device)
    partials = [weighted.new_zeros(tokens_of[r], weighted.shape[-1]) for r in range(world)]
    for r in range(world):
        mine = source == r
        partials[r].index_add_(0, token[mine], weighted[mine])
    back = all_to_all_rows(torch.cat(partials), tokens_of, [t] * world, group).reshape(world, t, y.shape[-1])
    out = back[0]
    for r in range(1, world):
        out = out + back[r]
    return out
