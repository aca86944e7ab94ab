"""Exact top-k / top-p / min-p sampling: the support and the renormalised log-probabilities, from strict rows.

Contract (torch v1, any device; `rl_kernel.backends.torch.truncation` states the steps): the support of a
token's distribution is a prefix of its strict fp32 log-probabilities (`rl_kernel.log_softmax`) sorted by
(lp descending, token id ascending), cut by top-k, then top-p over the top-k renormalised mass (a 2^-44
fixed-point int64 prefix sum: exact, order-free), then min-p (p >= min_p * p_max); the recorded
log-probability of a kept token is lp - log(support mass) in fp64, rounded once to fp32; -inf elsewhere.
An engine applies it to the rows it samples from (`truncate_log_softmax`); a trainer rebuilds each row
from its own strict logits and takes the same entry (`rl_kernel.logprobs(..., truncation=...)`, in
`rl_kernel.ops.logprob`): equal bits. The trainer's pass also yields each token's entropy over the full
vocabulary (no bit contract; an order-free int64 sum).
"""

from __future__ import annotations

import dataclasses

import torch

from rl_kernel import evidence
from rl_kernel.backends.torch import truncation as kernels
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


def sort_width(truncation: Truncation | list[Truncation], rows: int) -> int | None:
    """The sorted positions the support can reach when every row has a top-k (else None: all)."""
    ks = [t.top_k for t in _each(truncation, rows)]
    return max(ks) if ks and min(ks) > 0 else None


def row_params(truncation: Truncation | list[Truncation], rows: int, device) -> tuple[torch.Tensor, ...]:
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
    params = row_params(truncation, logprobs.shape[0], logprobs.device)
    active = (params[0] > 0) | (params[1] < 1.0) | (params[2] > 0.0)
    if not TRUNCATION.is_strict():
        TRUNCATION.record_native(logprobs.device)
        return torch.where(active.unsqueeze(-1), native_truncate(logprobs, *params), logprobs)
    evidence.record(CONTRACT, "strict", logprobs.device.type)
    out = logprobs.clone()
    rows = active.nonzero().squeeze(-1)
    if rows.numel():
        live = [t for t in _each(truncation, logprobs.shape[0]) if t.active]
        out[rows] = kernels.truncate(logprobs[rows], *(p[rows] for p in params), sort_width(live, len(live)))[0]
    return out
