"""Exact top-k / top-p / min-p truncation of strict log-probability rows (any device: torch integer, fp64 and
sort ops only, each exact or correctly rounded, plus rl_kernel's exp64 / log64).

A row is the fp32 strict log-probabilities lp[0..V) of one token (`rl_kernel.log_softmax`'s output, -inf on
padded columns). Its order is lp descending, ties by token id ascending (a stable descending sort). In that
order, e_i = exp64(fp64(lp_i) - fp64(max lp)) (the probability relative to the most likely token),
q_i = rint(e_i 2^FIXED_POINT_BITS) as int64 and C_i = q_0 + ... + q_i (int64: exact in any order). The support
is the first n tokens, n = min(n_k, n_p, n_m) over the real (finite) tokens V_real:
  n_k = top_k when 0 < top_k < V_real, else V_real;
  n_p = #{i < n_k : C_{i-1} < fp64(top_p) * fp64(C_{n_k - 1})} (C_{-1} = 0) when top_p < 1, else n_k
        (top-p over the top-k renormalised distribution, as vLLM and HF apply them);
  n_m = #{i : e_i >= fp64(min_p)} when min_p > 0, else V_real.
Every rule keeps a prefix of the order and keeps the most likely token, so n >= 1. The renormalised
log-probability of a kept token v is fp32((fp64(lp_v) - fp64(max lp)) - log64(fp64(C_{n-1}) 2^-44)); tokens
outside the support get -inf. Every value C below 2^53 is exact in fp64.
"""

from __future__ import annotations

import torch

from rl_kernel.backends.torch.numerics import exp64, log64

FIXED_POINT_BITS = 44


def sorted_stats(
    lp: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [T, W] token ids, e [T, W] fp64 in that order, C [T, W] int64 inclusive prefix sums, max lp [T]
    fp64) of fp32 rows lp [T, V], for the first W = `width` (default V) positions of the order."""
    values, order = torch.sort(lp, dim=-1, descending=True, stable=True)
    if width is not None and width < lp.shape[-1]:
        values, order = values[:, :width], order[:, :width]
    top = values[:, :1].to(torch.float64)
    e = exp64(values.to(torch.float64) - top)
    e = torch.where(torch.isneginf(values), 0.0, e)
    q = torch.round(e * float(1 << FIXED_POINT_BITS)).to(torch.int64)
    return order, e, torch.cumsum(q, dim=-1), top.squeeze(-1)


def support_size(
    e: torch.Tensor,
    cum: torch.Tensor,
    real: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """n [T] int64: the support size of each row (module docstring), from `sorted_stats`' e and C, the real
    token count per row, and per-row top_k (int64; <= 0: off), top_p (fp64; 1: off), min_p (fp64; 0: off)."""
    rows, width = e.shape
    n_k = torch.where((top_k > 0) & (top_k < real), top_k, real)
    mass_k = cum.gather(-1, (n_k - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1).to(torch.float64)
    before = torch.cat([cum.new_zeros(rows, 1), cum[:, :-1]], dim=-1).to(torch.float64)
    position = torch.arange(width, device=e.device).unsqueeze(0)
    in_p = (before < (top_p * mass_k).unsqueeze(-1)) & (position < n_k.unsqueeze(-1))
    n_p = torch.where(top_p < 1.0, in_p.sum(-1), n_k)
    n_m = torch.where(min_p > 0.0, (e >= min_p.unsqueeze(-1)).sum(-1), real)
    return torch.minimum(torch.minimum(n_k, n_p), n_m).clamp(min=1)


def truncate(
    lp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of fp32 strict rows lp [T, V]: (the renormalised fp32 log-probabilities [T, V], -inf outside each row's
    support; the support's last kept token per row as (its lp, fp32 [T], its id, int64 [T]); the fp64 log
    normaliser [T], max lp + log(C_{n-1} 2^-44), so that p = exp(lp - normaliser) on the support).
    `width`: when every row has 0 < top_k <= width, only the first `width` sorted positions are worked on (the
    support lies within them, and every C up to there is the same): the same bits, less fp64 work."""
    order, e, cum, top = sorted_stats(lp, width)
    n = support_size(e, cum, torch.isfinite(lp).sum(-1), top_k, top_p, min_p)
    log_mass = log64(cum.gather(-1, (n - 1).unsqueeze(-1)).to(torch.float64) * (1.0 / (1 << FIXED_POINT_BITS)))
    kept = torch.arange(order.shape[-1], device=lp.device).unsqueeze(0) < n.unsqueeze(-1)
    kept = torch.zeros(lp.shape, dtype=torch.bool, device=lp.device).scatter(-1, order, kept)  # token order
    out = ((lp.to(torch.float64) - top.unsqueeze(-1)) - log_mass).to(torch.float32)
    last = order.gather(-1, (n - 1).unsqueeze(-1))
    cut_lp = lp.gather(-1, last).squeeze(-1)
    return torch.where(kept, out, float("-inf")), cut_lp, last.squeeze(-1), top + log_mass.squeeze(-1)


def in_support(lp: torch.Tensor, cut_lp: torch.Tensor, cut_id: torch.Tensor, first_id: int = 0) -> torch.Tensor:
    """Bool [T, V_local]: token (first_id + column) is in the support whose last kept token is (cut_lp, cut_id)
    in the order (lp descending, id ascending)."""
    ids = first_id + torch.arange(lp.shape[-1], device=lp.device).unsqueeze(0)
    c = cut_lp.unsqueeze(-1)
    return (lp > c) | ((lp == c) & (ids <= cut_id.unsqueeze(-1)))
