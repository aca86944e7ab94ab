"""MoE boundary: the router, the grouped expert MLP and the combine of a mixture-of-experts layer (Qwen3-MoE).

A token's route and output are functions of that token alone: the rollout and the trainer, running these ops,
pick the same experts for every token by construction, with no routing replay.

- `moe_route(x, weight, top_k, renormalize)`: fp32 logits by the strict GEMM (`rk.linear_fp32`), a fixed-order
  fp32 softmax, the top k with ties to the lower expert id, the weights renormalised over the k
  (`norm_topk_prob`) by a fixed tree. Returns (fp32 weights [T, k], int64 ids [T, k]) in ascending expert id.
- `moe_experts(x, ids, gate_up, down)`: every (token, slot) row through its expert's SwiGLU MLP, rows grouped by
  expert; a row's fp32 output does not depend on how many rows its expert got or where they sit (no split-K,
  the same per-row reduction at every group size). Returns fp32 [T, k, D], unrounded.
- `moe_combine(y, weights, ids, dtype)`: per token, the k weighted expert outputs summed in fp32 in ascending
  expert id, rounded once to `dtype`.

Native forms: the framework's MoE (HF Qwen3MoeSparseMoeBlock's order): the router's logits rounded to x's
dtype by F.linear, torch.softmax and torch.topk; per-expert F.linear in x's dtype; weighted outputs summed in
x's dtype. Gradients carry no bit contract (fp32 on the CPU, x's dtype on CUDA, as the GEMM's backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_kernel.ops import library
from rl_kernel.ops.gemm import linear_fp32
from rl_kernel.ops.spec import OpSpec

_KERNELS = {"torch": "rl_kernel.backends.torch.moe", "triton": "rl_kernel.backends.triton.moe"}


def check_top_k(top_k: int, num_experts: int) -> None:
    """ValueError unless 1 <= top_k <= num_experts."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"MoE top-k (num_experts_per_tok) = {top_k} must lie in [1, num_experts={num_experts}]")


def _ascending(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1, stable=True)
    return weights.gather(-1, order), ids


def native_route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router: F.linear in x's dtype, fp32 softmax, torch.topk, renormalised in fp32 (ids sorted after)."""
    probs = torch.softmax(F.linear(x, weight.to(x.dtype)), dim=-1, dtype=torch.float32)
    picked, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        picked = picked / picked.sum(-1, keepdim=True)
    return _ascending(picked, ids)


def native_experts(
    x: torch.Tensor, counts: torch.Tensor | list[int], gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """HF's expert loop over rows sorted by expert: F.linear and SwiGLU in x's dtype; fp32 [R, D]."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()  # HF's loop reads the counts on the host too
    out = torch.empty(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(x[start : start + n], gate_up[e].to(x.dtype)).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, down[e].to(x.dtype)).to(torch.float32)
        start += n
    return out


def native_combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's combine: each expert output and its weight in `dtype`, their products summed in `dtype`."""
    return (y.to(dtype) * weights.to(dtype).unsqueeze(-1)).sum(dim=1)


ROUTER = OpSpec("moe_router", "moe", __name__, native=native_route, kernels=_KERNELS)
EXPERTS = OpSpec("moe_experts", "moe", __name__, native=native_experts, kernels=_KERNELS)
COMBINE = OpSpec("moe_combine", "moe", __name__, native=native_combine, kernels=_KERNELS)

_ROUTER_TERMS = dict(
    input_dependency="weights[t], ids[t] depend on x[t, :], the router weight, top_k, renormalize only",
    partition="logits: the GEMM contract's; softmax and renormalisation: the E experts' lanes",
    merge_order="max exact; exp sum and renormalising sum by a pairwise tree of neighbours over the E lanes "
    "(lanes not picked are 0 in the renormalising sum); top k by probability, ties to the lower expert id; "
    "ids returned in ascending order",
    precision="fp32 logits (the GEMM contract, unrounded), fp32 softmax and weights",
    rounding="exp64 rounded to fp32; one rounding per IEEE op; weights not rounded to x's dtype",
)
_EXPERTS_TERMS = dict(
    input_dependency="the output of row (t, j) depends on x[t, :] and expert ids[t, j]'s weights only "
    "(not on the other rows, their number or their order)",
    precision="fp32 products and accumulators; gate/up rounded to x's dtype before SwiGLU (the activation "
    "contract); down left in fp32",
    rounding="gate/up rounded once to x's dtype; SwiGLU rounded once to x's dtype; down not rounded",
)
_COMBINE_TERMS = dict(
    input_dependency="out[t, :] depends on y[t], weights[t], ids[t] only",
    partition="none: the k slots of a token",
    merge_order="slots in ascending expert id; acc = w0 * y0, then acc = acc + wj * yj left to right",
    precision="fp32 products and sum",
    rounding="the sum rounded once to the output dtype",
)
ROUTER.contract(
    "torch", 1, **_ROUTER_TERMS, primitives="IEEE fp32 sub, div, add; rl_kernel exp64; exact comparison sort"
)
ROUTER.contract(
    "triton",
    1,
    **_ROUTER_TERMS,
    primitives="IEEE fp32 sub, div_rn, add (no FMA); rl_kernel exp64 in Triton; k passes of max with the lowest "
    "id among equals",
)
EXPERTS.contract(
    "torch",
    1,
    **_EXPERTS_TERMS,
    partition="per expert: the GEMM contract (torch v1: K in 8 groups, blocks of 64) on its rows",
    merge_order="the GEMM contract's, per row; no split-K; rows of an expert in any number and order",
    primitives="IEEE fp32 mul and add, no FMA; the activation contract's exp",
)
EXPERTS.contract(
    "triton",
    1,
    **_EXPERTS_TERMS,
    partition="per expert: one K chain (the GEMM contract's one-group linear) on its rows, row tiles that never "
    "cross an expert's end",
    merge_order="one fp32 accumulator from zero, k16 steps in ascending K (no split-K), at every group size",
    primitives="tensor-core mma with fp32 accumulators (bf16/fp16), ieee fp32 dots (fp32); the activation "
    "contract's Triton kernel",
)
COMBINE.contract("torch", 1, **_COMBINE_TERMS, primitives="IEEE fp32 mul and add, no FMA")
COMBINE.contract("triton", 1, **_COMBINE_TERMS, primitives="IEEE fp32 mul and add, no FMA (fp fusion off)")


# ---- router ----------------------------------------------------------------------------------------


class _StrictRoute(torch.autograd.Function):
    """Forward under the router contract; backward through softmax, the pick and the renormalisation in fp32."""

    @staticmethod
    def forward(ctx, x, weight, top_k, renormalize):
        _, kernels = ROUTER.strict(x.device, x, weight)
        x2d = x.reshape(-1, x.shape[-1])
        logits = linear_fp32(x2d, weight)
        weights, ids = kernels.route(logits, top_k, renormalize)
        ctx.save_for_backward(x2d, weight, logits, ids)
        ctx.renormalize, ctx.x_shape = renormalize, x.shape
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights, _grad_ids):
        x2d, weight, logits, ids = ctx.saved_tensors
        probs = torch.softmax(logits, dim=-1)
        g = grad_weights.to(torch.float32)
        picked = probs.gather(-1, ids)
        if ctx.renormalize:
            total = picked.sum(-1, keepdim=True)
            g = (g - (g * picked / total).sum(-1, keepdim=True)) / total
        dp = torch.zeros_like(probs).scatter(-1, ids, g)
        dlogits = probs * (dp - (dp * probs).sum(-1, keepdim=True))
        grad_x = (dlogits @ weight.to(torch.float32)).to(x2d.dtype).reshape(ctx.x_shape)
        grad_w = (dlogits.T @ x2d.to(torch.float32)).to(weight.dtype)
        return grad_x, grad_w, None, None


def moe_route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens x [T, D] with the router weight [E, D]: (fp32 weights [T, k], int64 ids [T, k]), the ids
    in ascending order. `renormalize`: the k weights sum to one (Qwen3-MoE's norm_topk_prob)."""
    check_top_k(top_k, weight.shape[0])
    return ROUTER(lambda *a: _StrictRoute.apply(*a), x, weight, top_k, renormalize)


# ---- experts ---------------------------------------------------------------------------------------


class _StrictExperts(torch.autograd.Function):
    """Forward under the experts contract on the rows x[source // slots] (x the tokens [T, D], source the
    stable order of the (token, slot) rows by expert); backward per expert by matmuls (fp32 on the CPU, x's
    dtype on CUDA), a token's k slot gradients summed in slot order (no atomics)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, counts, source, slots):
        _, kernels = EXPERTS.strict(x.device, x, gate_up, down)
        ctx.save_for_backward(x, gate_up, down, source)
        ctx.counts, ctx.slots = counts, slots
        return kernels.grouped_mlp(x, counts, gate_up, down, source=source, slots=slots)

    @staticmethod
    def backward(ctx, grad_out):
        tokens, gate_up, down, source = ctx.saved_tensors
        x = tokens[source // ctx.slots]
        dtype = x.dtype if x.is_cuda and x.dtype == gate_up.dtype else torch.float32
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (x, gate_up, down)]
        start = 0
        for e, n in enumerate(ctx.counts.tolist()):  # the trainer's backward: a host read is fine here
            if n:
                rows = slice(start, start + n)
                with torch.enable_grad():
                    leaves = [t.detach().to(dtype).requires_grad_() for t in (x[rows], gate_up[e], down[e])]
                    xe, gu, dw = leaves
                    gate, up = (xe @ gu.T).chunk(2, dim=-1)
                    y = (F.silu(gate) * up) @ dw.T
                    gx, ggu, gdw = torch.autograd.grad(y, leaves, grad_out[rows].to(dtype))
                grads[0][rows], grads[1][e], grads[2][e] = gx, ggu, gdw
            start += n
        by_slot = torch.empty_like(grads[0])
        by_slot[source] = grads[0]
        grad_x = by_slot.view(tokens.shape[0], ctx.slots, -1).sum(1)
        return grad_x.to(tokens.dtype), grads[1].to(gate_up.dtype), grads[2].to(down.dtype), None, None, None


def expert_order(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, place, counts) of int64 expert ids [R]: `order` the stable sort of the rows by expert id
    (`torch.argsort(flat_ids, stable=True)`), `place` its inverse (row i sits at place[i] once sorted), `counts`
    [experts] the rows of each expert. Exact integers by a counting sort, with no device sort (radix sorts were
    two of every strict MoE layer's decode kernels on the H200, 28 us each at 512 rows) and no host read, so a
    CUDA graph captures it. CUDA: the Triton backend's `dispatch` (two launches); elsewhere the torch backend's
    (one scan of a flat one-hot; a scan along a dimension of a 2-D tensor runs one thread per column on CUDA,
    0.55 ms a layer at 2,048 rows on the H100)."""
    if flat_ids.is_cuda:
        from rl_kernel.backends.triton import moe as kernels
    else:
        from rl_kernel.backends.torch import moe as kernels
    return kernels.dispatch(flat_ids, experts)


def _sorted_experts(
    x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [T * k, D] the (token, slot) rows' expert outputs, sorted by expert; int64 place [T * k]: slot
    (t, j) sits at row place[t * k + j])."""
    k = ids.shape[1]
    order, place, counts = expert_order(ids.reshape(-1), gate_up.shape[0])
    tokens = x.reshape(-1, x.shape[-1])
    out = EXPERTS(
        lambda *a: _StrictExperts.apply(*a, counts, order, k),
        tokens,
        gate_up,
        down,
        native_form=lambda t, gu, dn: native_experts(t[order // k], counts, gu, dn),
    )
    return out, place


def moe_experts(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """fp32 [T, k, D]: token t through expert ids[t, j]'s SwiGLU MLP, gate_up [E, 2I, D] (gate rows first),
    down [E, D, I]. The (token, slot) rows are grouped by expert (`expert_order`; the strict GEMM reads them from
    x in place) and put back. The forward reads nothing back to the host on CUDA (a CUDA graph captures it)."""
    out, place = _sorted_experts(x, ids, gate_up, down)
    return out[place].reshape(*ids.shape, down.shape[1])


# ---- combine ---------------------------------------------------------------------------------------


class _StrictCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, dtype, place):
        _, kernels = COMBINE.strict(y.device, y, weights)
        ctx.save_for_backward(y, weights, place)
        return kernels.combine(y, weights, dtype, place)

    @staticmethod
    def backward(ctx, grad_out):
        y, weights, place = ctx.saved_tensors
        g = grad_out.to(torch.float32).unsqueeze(1)
        if place is None:
            return g * weights.unsqueeze(-1), (g * y).sum(-1), None, None
        grad_y = torch.empty_like(y)
        grad_y[place] = (g * weights.unsqueeze(-1)).reshape(-1, y.shape[-1])
        return grad_y, (g * y[place].view(*weights.shape, -1)).sum(-1), None, None


def moe_combine(
    y: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    ascending: bool = False,
    place: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, D] in `dtype`: sum over j of weights[t, j] * y[t, j] (y fp32 [T, k, D], weights fp32 [T, k]), the
    slots taken in ascending expert id ids[t, j]. With `place` (int64 [T * k]), y is [T * k, D] with slot (t, j)
    at row place[t * k + j] (`_sorted_experts`' rows, read in place). `ascending`: the caller's ids already
    ascend along each row (`moe_route`'s do), so the slots are taken as they stand, without a sort."""
    if not ascending:
        order = ids.argsort(dim=-1, stable=True)
        weights = weights.gather(1, order)
        if place is None:
            y = y.gather(1, order.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
        else:
            place = place.view(ids.shape).gather(1, order).reshape(-1)
    return COMBINE(
        lambda *a: _StrictCombine.apply(*a),
        y,
        weights,
        dtype,
        place,
        native_form=lambda y_, w, d, p: native_combine(y_ if p is None else y_[p].view(*w.shape, -1), w, d),
    )


def moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen3-MoE sparse block on x [T, D]: (output [T, D] in x's dtype, int64 expert ids [T, k] ascending)."""
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _moe_op(x, router_weight, gate_up, down, top_k, renormalize)
    weights, ids = moe_route(x, router_weight, top_k, renormalize)
    y, place = _sorted_experts(x, ids, gate_up, down)
    return moe_combine(y, weights, ids, x.dtype, ascending=True, place=place), ids


# ---- the block as one opaque node for torch.compile (rl_kernel.ops.library) ----


@torch.library.custom_op(f"{library.LIB}::moe", mutates_args=())
def _moe_op(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, ids = moe(x, router_weight, gate_up, down, top_k, renormalize)
    return out.contiguous(), ids.contiguous()


@_moe_op.register_fake
def _moe_fake(x, router_weight, gate_up, down, top_k, renormalize):
    return library.like(x), library.like(x, x.shape[0], top_k, dtype=torch.int64)
