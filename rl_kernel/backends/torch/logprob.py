"""Strict selected-token log-probability on the torch backend, optionally vocab-parallel.

The log-sum-exp is made exact and order-free: with M the (exact) max of z = logits / temperature,
every term exp(z - M) in (0, 1] is rounded to a fixed-point integer with FIXED_POINT_BITS
fractional bits and the terms are added as int64. Integer addition is associative, so the sum is
the same for any vocab tiling, any sharding over ranks and any reduction order, and the max is
exact too. This is what lets a vocab-parallel logprob equal the unsharded one bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rl_kernel.backends.torch.numerics import exp64, log64

FIXED_POINT_BITS = 44
MAX_VOCAB = 1 << (62 - FIXED_POINT_BITS)  # the int64 sum of MAX_VOCAB terms <= 1 cannot overflow
TILE_ELEMENTS = 1 << 22


def exact_all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    """x reduced in place over `group` (nothing without one, or alone). For exact reductions only (max; int64 sum;
    a sum with a single non-zero term), whose result no order can change."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def scaled_logits(
    logits32: torch.Tensor,
    temperature: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """z = logits / temperature in fp64, -inf on padded columns (global index >= vocab_size); the fp32 logits
    first rounded once to `logits_dtype` (the contract's logit dtype)."""
    z = logits32.to(logits_dtype).to(torch.float64) / temperature.to(torch.float64).unsqueeze(-1)
    column = vocab_start + torch.arange(z.shape[-1], device=z.device)
    return torch.where(column < vocab_size, z, -math.inf)


def logprobs_and_lse(
    logits_fn,
    rows: int,
    vocab_local: int,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    logits_dtype: torch.dtype = torch.float32,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logprobs [T] and fp64 lse [T]. `logits_fn(a, b)` gives the fp32 logits of rows a:b of
    this rank's vocab slice [b - a, vocab_local] under the GEMM contract, rounded to `logits_dtype`.
    `entropy` (fp32 [T]) receives each row's full-vocab entropy (`entropy_of_tile`)."""
    device = targets.device
    out = torch.empty(rows, dtype=torch.float32, device=device)
    lse_out = torch.empty(rows, dtype=torch.float64, device=device)
    tile = max(1, TILE_ELEMENTS // max(1, vocab_local))
    for a in range(0, rows, tile):
        b = min(rows, a + tile)
        z = scaled_logits(logits_fn(a, b), temperature[a:b], vocab_start, vocab_size, logits_dtype)
        m = exact_all_reduce(z.amax(-1), dist.ReduceOp.MAX, group)
        e = exp64(z - m.unsqueeze(-1))
        terms = torch.round(e * float(1 << FIXED_POINT_BITS)).to(torch.int64)
        total = exact_all_reduce(terms.sum(-1), dist.ReduceOp.SUM, group)  # int64: exact in any order
        local = targets[a:b] - vocab_start
        owned = (local >= 0) & (local < vocab_local)
        z_t = torch.where(owned, z.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1), 0.0)
        z_t = exact_all_reduce(z_t, dist.ReduceOp.SUM, group)  # one owner: x + 0 + ... + 0 is exact
        lse = m + log64(total.to(torch.float64) * (1.0 / (1 << FIXED_POINT_BITS)))
        out[a:b] = (z_t - lse).to(torch.float32)
        lse_out[a:b] = lse
        if entropy is not None:
            entropy[a:b] = entropy_of_tile(z, m, e, total, lse, group)
    return out, lse_out


def entropy_of_tile(
    z: torch.Tensor,
    m: torch.Tensor,
    e: torch.Tensor,
    total: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """fp32 entropy [rows] of the softmax of z [rows, V_local] (this rank's slice; -inf on padded columns), from
    the logprob pass's own numbers: the max m, e = exp64(z - m), the int64 fixed-point total and the lse.
    H = (lse - m) + A / total with A = sum of rint(e (m - z) 2^44) in int64 (each term <= 1/e: exact and
    order-free over tiles and ranks, like the lse; no bit contract is claimed for it)."""
    term = torch.where(e > 0, e * (m.unsqueeze(-1) - z), 0.0)
    spread = exact_all_reduce(
        torch.round(term * float(1 << FIXED_POINT_BITS)).to(torch.int64).sum(-1), dist.ReduceOp.SUM, group
    )
    return ((lse - m) + spread.to(torch.float64) / total.to(torch.float64)).to(torch.float32)


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    keep: list | None = None,
    logits_dtype: torch.dtype = torch.float32,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The strict forward of `rl_kernel.logprobs`: (fp32 logprobs [T], fp64 lse [T]), the logits by the GEMM op
    (`rl_kernel.linear_fp32`, row tiles) rounded to `logits_dtype`. `keep` is left empty: the backward
    recomputes the logits. `entropy` (fp32 [T]) receives the full-vocab entropy of each row."""
    from rl_kernel.ops.gemm import linear_fp32

    return logprobs_and_lse(
        lambda a, b: linear_fp32(hidden[a:b], weight),
        hidden.shape[0],
        weight.shape[0],
        targets,
        temperature,
        vocab_start,
        vocab_size,
        group,
        logits_dtype,
        entropy,
    )


def full_log_softmax(
    logits32: torch.Tensor,
    temperature: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fp32 log-probabilities of every column of this rank's slice (-inf on padded columns), by the
    same steps as `logprobs_and_lse`: the entry of a target equals its `logprobs` value bit for bit."""
    out = torch.empty(logits32.shape, dtype=torch.float32, device=logits32.device)
    tile = max(1, TILE_ELEMENTS // max(1, logits32.shape[-1]))
    for a in range(0, logits32.shape[0], tile):
        z = scaled_logits(logits32[a : a + tile], temperature[a : a + tile], vocab_start, vocab_size, logits_dtype)
        m = exact_all_reduce(z.amax(-1), dist.ReduceOp.MAX, group)
        terms = torch.round(exp64(z - m.unsqueeze(-1)) * float(1 << FIXED_POINT_BITS)).to(torch.int64)
        total = exact_all_reduce(terms.sum(-1), dist.ReduceOp.SUM, group)
        lse = m + log64(total.to(torch.float64) * (1.0 / (1 << FIXED_POINT_BITS)))
        out[a : a + tile] = (z - lse.unsqueeze(-1)).to(torch.float32)
    return out


def backward(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    kept: list | None = None,
    tile_elements: int = TILE_ELEMENTS,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of logprob = z[target] - lse with z = hidden @ weight.T / T, for the forward's fp64
    `lse`: d/dz = (onehot - softmax) * grad / T. fp32 matmuls in row tiles (never all logits at once);
    the hidden gradient of a vocab slice is summed over ranks. Returns (grad_hidden, grad_weight). `kept`
    (logits kept by the forward) is unused: this forward keeps none. With `grad_entropy` (and the forward's
    `entropy` H) the entropy's gradient is added: dH/dz = -p (log p + H)."""
    v_local = weight.shape[0]
    w32 = weight.to(torch.float32)
    grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_w = torch.zeros_like(w32)
    column = vocab_start + torch.arange(v_local, device=hidden.device)
    tile = max(1, tile_elements // v_local)
    for a in range(0, hidden.shape[0], tile):
        h32 = hidden[a : a + tile].to(torch.float32)
        t32 = temperature[a : a + tile].to(torch.float32).unsqueeze(-1)
        z = (h32 @ w32.T) / t32
        p = torch.where(column < vocab_size, torch.exp(z - lse[a : a + tile].to(torch.float32).unsqueeze(-1)), 0.0)
        local = targets[a : a + tile].to(torch.int64) - vocab_start
        owned = ((local >= 0) & (local < v_local)).nonzero().squeeze(-1)
        p[owned, local[owned]] -= 1.0  # softmax - onehot
        dlogits = p * (-grad_out[a : a + tile].to(torch.float32).unsqueeze(-1) / t32)
        if grad_entropy is not None:
            log_p = z - lse[a : a + tile].to(torch.float32).unsqueeze(-1)
            real = column < vocab_size
            spread = torch.where(real, log_p + entropy[a : a + tile].to(torch.float32).unsqueeze(-1), 0.0)
            prob = torch.where(real, torch.exp(log_p), 0.0)
            dlogits -= prob * spread * (grad_entropy[a : a + tile].to(torch.float32).unsqueeze(-1) / t32)
        grad_h[a : a + tile] = dlogits @ w32
        grad_w += dlogits.T @ h32
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(grad_h, group=group)
    return grad_h.to(hidden.dtype), grad_w.to(weight.dtype)
