"""Strict Gumbel-max sampling (any device: torch integer ops, two fp32 logs per entry, an argmax).

Row t of fp32 log-probabilities lp [T, V] (`rl_kernel.log_softmax`'s output, maybe truncated: -inf outside
the support) samples its token from a 64-bit key (`rl_kernel.ops.sampling.row_keys`, from the request's seed
and the token's position in its response). Entry v's noise is a function of (key, v) alone:
  h = fmix32(fmix32(v ^ lo32(key)) ^ hi32(key))        uint32 (murmur3's finaliser, wrapping)
  u = (2 (h >> 9) + 1) 2^-24                            exact in fp32; 2^-24 <= u <= 1 - 2^-24
  g = -log(-log(u))                                     fp32 logs (a standard Gumbel, truncated to [-2.8, 16.6])
and the token is argmax_v (lp_v + g_v) in fp32, NaN scores counted as +inf, the lowest id on ties: a sample of
softmax(lp) (Gumbel-max). The row is then replaced by -inf everywhere but the token, whose entry keeps its
log-probability bits: an engine that takes the argmax of the row samples exactly that token and records its
log-probability unchanged.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values (products wrap; the low 32 bits kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [T, vocab] noise g[t, v] of row keys [T] (int64, the bits of a uint64)."""
    lo = (keys & MASK32).unsqueeze(-1)
    hi = ((keys >> 32) & MASK32).unsqueeze(-1)
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    h = fmix32(fmix32(ids ^ lo) ^ hi)
    u = ((h >> 9) * 2 + 1).to(torch.float32) * 2.0**-24
    return -torch.log(-torch.log(u))


def scores(picked: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """fp32 scores lp + g of log-prob rows `picked` [R, V] under keys [R], NaN as +inf: the token is the argmax."""
    score = picked + gumbel_noise(keys, picked.shape[-1])
    return torch.where(torch.isnan(score), float("inf"), score)


def one_hot_(lp: torch.Tensor, rows: torch.Tensor, picked: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of lp (their values `picked`) replaced by -inf but each token's own entry; returns tokens."""
    keep = picked.gather(-1, tokens.unsqueeze(-1))
    lp.index_copy_(0, rows, torch.full_like(picked, float("-inf")).scatter_(-1, tokens.unsqueeze(-1), keep))
    return tokens


def sample_(lp: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Sample rows `rows` (int64 [R]) of fp32 lp [T, V] with keys [R], making each such row one-hot (-inf
    but the token's own log-probability bits) in place; returns the tokens (int64 [R])."""
    picked = lp.index_select(0, rows)
    return one_hot_(lp, rows, picked, scores(picked, keys).argmax(-1))  # argmax: the lowest id on ties


def decisive(score: torch.Tensor, ulps: float = 64.0) -> torch.Tensor:
    """bool [R]: rows of `score` [R, V] whose best score beats the runner-up by more than `ulps` fp32 ulps of the
    best's magnitude (and 1e-6), or that have no finite score (token 0 on every backend): there, backends whose
    fp32 logs differ by a few ulps must pick the same token."""
    top = score.topk(min(2, score.shape[-1]), -1).values
    if top.shape[-1] < 2:
        return torch.ones(score.shape[0], dtype=torch.bool, device=score.device)
    best = top[:, 0]
    bound = torch.where(best.isfinite(), best.abs() * (ulps * 2.0**-23) + 1e-6, 0.0)
    return ((best - top[:, 1]) > bound) | torch.isneginf(best)
