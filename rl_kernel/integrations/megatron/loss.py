"""GRPO / PPO policy loss on flat token tensors: pure torch, no Megatron, reusable by any trainer.

Per active token t (mask 1): ratio = exp(logp - old_logp); the clipped surrogate
pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)); with `kl_coef` > 0 the k3
estimator of KL(pi || ref), kl = exp(ref - logp) - (ref - logp) - 1, is added as kl_coef * kl.
The loss is sum(mask * (pg + kl_coef * kl)) / normalizer, where the normalizer defaults to the
number of active tokens; pass the batch's total so micro-batches add up to the batch mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0:
            raise ValueError(f"clip_low, clip_high and kl_coef must be >= 0, got {self}")


def policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(), ref_logprobs: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of the clipped policy-gradient objective; all inputs [N] per token, fp32.

    metrics (detached sums over active tokens, to be divided by the token count by the caller):
    pg_sum, kl_sum, clipped (count of tokens whose clipped term won), ratio_sum, tokens."""
    shapes = {t.shape for t in (logprobs, old_logprobs, advantages, mask)}
    if len(shapes) != 1 or logprobs.dim() != 1:
        raise ValueError(f"logprobs, old_logprobs, advantages and mask must all be [N]; got {shapes}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs.to(logprobs.dtype)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {"pg_sum": (per_token * mask).sum().detach(),
               "clipped": ((clipped > unclipped).to(mask.dtype) * mask).sum().detach(),
               "ratio_sum": (ratio * mask).sum().detach(), "tokens": mask.sum().detach()}
    if config.kl_coef > 0:
        delta = ref_logprobs.to(logprobs.dtype) - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_coef * kl
        metrics["kl_sum"] = (kl * mask).sum().detach()
    denom = float(mask.sum()) if normalizer is None else float(normalizer)
    if denom <= 0:
        raise ValueError("no active tokens (mask is all zero and no normalizer given)")
    return (per_token * mask).sum() / denom, metrics
