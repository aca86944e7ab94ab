"""Strict mixture-of-experts kernels on the torch backend: router, grouped expert MLP, combine.

Router: over one token's fp32 logits l [E], m = max(l) (exact), e = exp32(l - m) (rl_kernel's exp, the
subtraction in fp32), s = the pairwise tree of neighbours over the E lanes, p = e / s (IEEE div). The k experts
of highest p are picked, ties to the lower expert id (an exact, stable comparison sort), and returned in
ascending expert id. Renormalised weights (norm_topk_prob): w = p / t, t the same tree over the E lanes with
every lane not picked zero (x + 0 is exact, so t is a fixed function of the picked values).

Grouped MLP: rows sorted by expert; each expert's rows run the GEMM contract's torch kernel (products and
sums elementwise, so a row's bits do not depend on how many rows its expert got or where they sit),
gate/up rounded to x's dtype, SwiGLU by the activation contract, down left in fp32.

Combine: per token, the k fp32 expert outputs times their fp32 weights, added left to right in ascending
expert id from the first product, rounded once.
"""

from __future__ import annotations

import torch

from rl_kernel.backends.torch import activation as torch_activation
from rl_kernel.backends.torch import gemm as torch_gemm
from rl_kernel.backends.torch.numerics import exp32, tree_sum


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 softmax [T, E] of fp32 logits [T, E] under the router contract."""
    m = logits.amax(-1, keepdim=True)  # a max is exact in any order
    e = exp32(logits - m)
    return e / tree_sum(e).unsqueeze(-1)


def top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """int64 expert ids [T, k] of the k highest probabilities (ties: the lower id), in ascending id."""
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices  # equal values keep id order
    return order[:, :k].sort(dim=-1).values


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, k], int64 ids [T, k] in ascending id) of fp32 router logits [T, E]."""
    probs = router_probs(logits)
    ids = top_k(probs, k)
    picked = probs.gather(-1, ids)
    if not renormalize:
        return picked, ids
    lanes = torch.zeros_like(probs).scatter(-1, ids, picked)
    return picked / tree_sum(lanes).unsqueeze(-1), ids


def grouped_linear_fp32(x: torch.Tensor, counts: torch.Tensor | list[int], weight: torch.Tensor) -> torch.Tensor:
    """fp32 [R, N]: rows x[start_e : start_e + counts[e]] times weight[e] [N, K].T by the GEMM contract (the
    counts read on the host: this backend runs on the CPU)."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    out = torch.empty(x.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = torch_gemm.matmul_fp32(x[start : start + n], weight[e])
        start += n
    return out


def grouped_mlp(
    x: torch.Tensor,
    counts: torch.Tensor | list[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    source: torch.Tensor | None = None,
    slots: int = 1,
) -> torch.Tensor:
    """fp32 [R, D]: each expert's SwiGLU MLP on its rows (sorted by expert, `counts` rows each: x's own, or with
    `source` row i = x[source[i] // slots]), the down projection unrounded. gate_up [E, 2I, D], down [E, D, I]."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    if source is not None:
        x = x[source // slots]
    h = grouped_linear_fp32(x, counts, gate_up).to(x.dtype)
    return grouped_linear_fp32(torch_activation.silu_and_mul(h), counts, down)


def combine(
    y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype, place: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, D] in `out_dtype`: sum_j weights[:, j] * y[:, j] in fp32, j ascending, rounded once. y fp32 [T, k, D]
    with its slots already in ascending expert id; or with `place` (int64 [T * k]), y [T * k, D] holds slot
    (t, j) at row place[t * k + j]."""
    if place is not None:
        y = y[place].reshape(*weights.shape, y.shape[-1])
    acc = y[:, 0] * weights[:, 0:1]
    for j in range(1, y.shape[1]):
        acc = acc + y[:, j] * weights[:, j : j + 1]
    return acc.to(out_dtype)


def dispatch(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, place, counts) of int64 expert ids [R] (`rl_kernel.ops.moe.expert_order`'s integers), a counting
    sort: the one-hot [E, R] of the ids, read expert by expert as one flat sequence, has at (e, r) the inclusive
    count of the rows of the experts before e plus the rows of e up to r, so at (ids[r], r) row r's place + 1.
    One scan of a flat tensor; nothing read back to the host (scatter_add, not bincount)."""
    rows = flat_ids.numel()
    counts = torch.zeros(experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    row = torch.arange(rows, device=flat_ids.device)
    one_hot = (torch.arange(experts, device=flat_ids.device)[:, None] == flat_ids[None, :]).to(torch.int32)
    place = one_hot.view(-1).cumsum(0, dtype=torch.int32)[flat_ids * rows + row].to(torch.int64) - 1
    order = torch.empty_like(place).scatter_(0, place, row)
    return order, place, counts
