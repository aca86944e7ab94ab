"""Exact top-k / top-p / min-p sampling: the support and the renormalised log-probabilities, from strict rows.

Contract (torch v1, any device; `rl_kernel.backends.torch.truncation` states the steps): the support of a
token's distribution is a prefix of its strict fp32 log-probabilities (`rl_kernel.log_softmax`) sorted by
(lp descending, token id ascending), cut by top-k, then top-p over the top-k renormalised mass (a 2^-44
fixed-point int64 prefix sum: exact, order-free), then min-p (p >= min_p * p_max); the recorded
log-probability of a kept token is lp - log(support mass) in fp64, rounded once to fp32; -inf elsewhere.
An engine applies it to the rows it samples from (`truncate_log_softmax`); a trainer rebuilds each row
from its own strict logits and takes the same entry (`truncated_logprobs`): equal bits. The trainer's
pass also yields each token's entropy over the full vocabulary (no bit contract; an order-free int64 sum).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl_kernel import evidence
from rl_kernel.backends.torch import truncation as kernels
from rl_kernel.backends.torch.logprob import TILE_ELEMENTS
from rl_kernel.backends.torch.numerics import exp64
from rl_kernel.ops.spec import OpSpec


@dataclasses.dataclass(frozen=True)
class Truncation:
    """Sampling truncation: top_k (-1 or 0: off), top_p in (0, 1] (1: off), min_p in [0, 1) (0: off)."""

    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: use -1 or 0 (off) or a positive token count")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: use 0 < top_p <= 1 (1: off)")
        if not (isinstance(self.min_p, int | float) and 0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p={self.min_p!r}: use 0 <= min_p < 1 (0: off)")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _each(truncation: Truncation | list[Truncation], rows: int) -> list[Truncation]:
    each = [truncation] * rows if isinstance(truncation, Truncation) else list(truncation)
    if len(each) != rows:
        raise ValueError(f"{rows} rows but {len(each)} truncations")
    return each


def _width(truncation: Truncation | list[Truncation], rows: int) -> int | None:
    """The sorted positions the support can reach when every row has a top-k (else None: all)."""
    ks = [t.top_k for t in _each(truncation, rows)]
    return max(ks) if ks and min(ks) > 0 else None


def _row_params(truncation: Truncation | list[Truncation], rows: int, device) -> tuple[torch.Tensor, ...]:
    """Per-row (top_k int64, top_p fp64, min_p fp64) [rows]."""
    each = _each(truncation, rows)
    k = torch.tensor([t.top_k for t in each], dtype=torch.int64, device=device)
    p = torch.tensor([float(t.top_p) for t in each], dtype=torch.float64, device=device)
    m = torch.tensor([float(t.min_p) for t in each], dtype=torch.float64, device=device)
    return k, p, m


def native_truncate(lp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Framework-style (as vLLM's sampler): top-k, then top-p by an fp32 softmax cumsum, then min-p, then
    log_softmax of the masked row."""
    x = lp.to(torch.float32)
    values, order = x.sort(-1, descending=True)
    k = torch.where(top_k > 0, top_k, x.shape[-1]).clamp(max=x.shape[-1])
    position = torch.arange(x.shape[-1], device=x.device)
    drop = position.unsqueeze(0) >= k.unsqueeze(-1)
    masked = values.masked_fill(drop, float("-inf"))
    probs = masked.softmax(-1)
    before = probs.cumsum(-1) - probs
    drop |= (before >= top_p.to(torch.float32).unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    drop |= probs < (min_p.to(torch.float32) * probs[:, :1].squeeze(-1)).unsqueeze(-1)
    drop[:, 0] = False
    masked = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter(-1, order, masked.log_softmax(-1))


TRUNCATION = OpSpec("truncation", "logprob", __name__, {"torch": kernels.__name__}, native=native_truncate)
CONTRACT = TRUNCATION.contract(
    "torch",
    1,
    input_dependency="out[t, v] depends on the strict fp32 log-probabilities of row t (all ranks' slices) and "
    "row t's top_k, top_p, min_p",
    partition="rows independent; the full row (ranks' slices gathered, a bit copy) at once",
    merge_order="stable sort by (lp desc, token id asc); int64 prefix sums of 2^-44 fixed-point terms (exact, "
    "any scan order)",
    precision="e = exp64(fp64(lp) - fp64(max lp)) in fp64; q = rint(e 2^44) int64; top-p test "
    "fp64(C_{i-1}) < fp64(top_p) * fp64(C_{n_k - 1}); min-p test e >= fp64(min_p)",
    rounding="kept entries fp32((fp64(lp) - fp64(max lp)) - log64(fp64(C_{n-1}) 2^-44)); others -inf",
    primitives="stable sort; rl_kernel exp64/log64; IEEE fp64 sub, mul, compare; int64 add",
    params=(("fixed_point_bits", kernels.FIXED_POINT_BITS),),
)
# It runs its torch form on every device (integer, fp64 and sort ops only), whatever the logprob backend.


def truncate_log_softmax(logprobs: torch.Tensor, truncation: Truncation | list[Truncation]) -> torch.Tensor:
    """Renormalised fp32 log-probabilities over each row's support (-inf outside) of full-vocab strict
    log-probability rows [T, V] (`rl_kernel.log_softmax`'s output; one Truncation or one per row). A row whose
    truncation is off is returned unchanged. The engine samples from this."""
    params = _row_params(truncation, logprobs.shape[0], logprobs.device)
    active = (params[0] > 0) | (params[1] < 1.0) | (params[2] > 0.0)
    if not TRUNCATION.is_strict():
        TRUNCATION.record_native(logprobs.device)
        return torch.where(active.unsqueeze(-1), native_truncate(logprobs, *params), logprobs)
    evidence.record(CONTRACT, "strict", logprobs.device.type)
    out = logprobs.clone()
    rows = active.nonzero().squeeze(-1)
    if rows.numel():
        live = [t for t in _each(truncation, logprobs.shape[0]) if t.active]
        out[rows] = kernels.truncate(logprobs[rows], *(p[rows] for p in params), _width(live, len(live)))[0]
    return out


def _gather_vocab(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[rows, V_local] slices of every rank -> [rows, V_local * world] (rank order; a bit copy)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def full_entropy(lp: torch.Tensor) -> torch.Tensor:
    """fp32 entropy [T] of fp32 log-probability rows [T, V] (-inf entries contribute 0): -sum p lp with
    p = exp64(lp), each term rounded to 2^-44 fixed point and summed in int64 (order-free, so any sharding
    gives the same value)."""
    lp64 = lp.to(torch.float64)
    term = torch.where(torch.isneginf(lp64), 0.0, exp64(lp64) * -lp64)
    return (
        torch.round(term * float(1 << kernels.FIXED_POINT_BITS)).to(torch.int64).sum(-1).to(torch.float64)
        * (1.0 / (1 << kernels.FIXED_POINT_BITS))
    ).to(torch.float32)


def _strict_rows(hidden, weight, temps, vocab_size, group):
    """Strict fp32 log-probabilities of this rank's vocab slice of rows `hidden` (the engine's steps)."""
    from rl_kernel.ops.gemm import linear_fp32
    from rl_kernel.ops.logprob import log_softmax

    return log_softmax(linear_fp32(hidden, weight), temps, vocab_size=vocab_size, group=group)


class TruncatedLogprobs(torch.autograd.Function):
    """Forward under the contract: per row tile, the strict rows (GEMM contract + log_softmax), gathered over
    the vocab ranks, truncated; the target's entry and the full-vocab entropy. Backward (no bit contract): the
    rows recomputed by the same steps, so the support is the forward's; d/dz = (onehot - p_support) g +
    g_H * (-p (log p + H)), over T."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temps, vocab_start, vocab_size, group, truncation):
        rows = hidden.shape[0]
        out = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        cut_lp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        cut_id = torch.empty(rows, dtype=torch.int64, device=hidden.device)
        norm = torch.empty(rows, dtype=torch.float64, device=hidden.device)
        params, width = _row_params(truncation, rows, hidden.device), _width(truncation, rows)
        world = dist.get_world_size(group) if group is not None else 1
        tile = max(1, TILE_ELEMENTS // max(1, weight.shape[0] * world))
        for a in range(0, rows, tile):
            b = min(rows, a + tile)
            lp = _gather_vocab(_strict_rows(hidden[a:b], weight, temps[a:b], vocab_size, group), group)
            trunc, cut_lp[a:b], cut_id[a:b], norm[a:b] = kernels.truncate(lp, *(p[a:b] for p in params), width)
            out[a:b] = trunc.gather(-1, targets[a:b].unsqueeze(-1)).squeeze(-1)
            ent[a:b] = full_entropy(lp)
        ctx.save_for_backward(hidden, weight, targets, temps, cut_lp, cut_id, norm, ent)
        ctx.vocab_start, ctx.vocab_size, ctx.group, ctx.tile = vocab_start, vocab_size, group, tile
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        hidden, weight, targets, temps, cut_lp, cut_id, norm, ent = ctx.saved_tensors
        grad_out = torch.zeros_like(ent) if grad_out is None else grad_out
        grad_ent = torch.zeros_like(ent) if grad_ent is None else grad_ent
        w32 = weight.to(torch.float32)
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.zeros_like(w32)
        v_local = weight.shape[0]
        for a in range(0, hidden.shape[0], ctx.tile):
            b = min(hidden.shape[0], a + ctx.tile)
            with torch.no_grad():
                lp = _strict_rows(hidden[a:b], weight, temps[a:b], ctx.vocab_size, ctx.group).to(torch.float64)
            keep = kernels.in_support(lp, cut_lp[a:b].to(torch.float64), cut_id[a:b], ctx.vocab_start)
            p_support = torch.where(keep, torch.exp(lp - norm[a:b].unsqueeze(-1)), 0.0)
            p = torch.where(torch.isneginf(lp), 0.0, torch.exp(lp))
            local = targets[a:b] - ctx.vocab_start
            owned = ((local >= 0) & (local < v_local)).nonzero().squeeze(-1)
            dz = -p_support * grad_out[a:b].to(torch.float64).unsqueeze(-1)
            dz[owned, local[owned]] += grad_out[a:b][owned].to(torch.float64)
            plogp = torch.where(p > 0, lp, 0.0)
            dz -= grad_ent[a:b].to(torch.float64).unsqueeze(-1) * p * (plogp + ent[a:b].to(torch.float64).unsqueeze(-1))
            dlogits = (dz / temps[a:b].to(torch.float64).unsqueeze(-1)).to(torch.float32)
            h32 = hidden[a:b].to(torch.float32)
            grad_h[a:b] = dlogits @ w32
            grad_w += dlogits.T @ h32
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad_h, group=ctx.group)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None, None, None, None


def native_truncated_logprobs(hidden, weight, targets, temps, vocab_start, vocab_size, group, truncation):
    """Framework-style: fp32 log-softmax of the model-dtype logits, gathered over the vocab ranks, vLLM-style
    truncation (`native_truncate`); (logprobs, entropy), differentiable by autograd."""
    from rl_kernel.ops.logprob import native_log_softmax

    logits = F.linear(hidden, weight.to(hidden.dtype)).to(torch.float32)
    lp = native_log_softmax(logits, temps, vocab_start, vocab_size, group)
    if group is not None and dist.get_world_size(group) > 1:
        from torch.distributed.nn.functional import all_gather  # differentiable

        lp = torch.cat(all_gather(lp, group=group), dim=-1)
    params = _row_params(truncation, hidden.shape[0], hidden.device)
    trunc = native_truncate(lp, *params)
    ent = -torch.where(torch.isneginf(lp), 0.0, lp.exp() * lp).sum(-1)
    return trunc.gather(-1, targets.unsqueeze(-1)).squeeze(-1), ent


def truncated_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temps: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    truncation: Truncation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log p_support(targets) [T], fp32 full-vocab entropy [T]): the trainer's side of the contract,
    equal in bits to the entry `truncate_log_softmax(log_softmax(linear_fp32(hidden, W)))` of each target (an
    engine's recorded value); a target outside its support gets -inf (the caller counts and refuses it).
    Differentiable in both outputs."""
    if not TRUNCATION.is_strict():
        TRUNCATION.record_native(hidden.device)
        return native_truncated_logprobs(hidden, weight, targets, temps, vocab_start, vocab_size, group, truncation)
    evidence.record(CONTRACT, "strict", hidden.device.type)
    out, ent = TruncatedLogprobs.apply(
        hidden, weight, targets.to(torch.int64), temps, vocab_start, vocab_size, group, truncation
    )
    return out, ent
