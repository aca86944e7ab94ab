"""GRPO: group-normalised advantages and the clipped policy loss (pure torch).

Advantages: within each group (the samples of one prompt) A_i = (r_i - mean(r)) / (std(r) + eps),
std unbiased (as torch.std); a group whose rewards are all equal gets A = 0 exactly.
Loss: per-token clipped surrogate  -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A),
ratio = exp(logp - logp_old), plus kl_coef * k3(logp, logp_ref), averaged over all active tokens.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_groups, group_size] -> advantages of the same shape (fp32)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, group_size >= 2], got {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite; a reward function returned NaN or inf")
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    tied = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)  # exactly 0, not rounding noise or 0/0
    return torch.where(tied, 0.0, adv).to(torch.float32)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_eps: float, kl_coef: float = 0.0,
                ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level GRPO loss. All tensors are [T] (packed response tokens); `advantages` is the
    sample's advantage repeated on its tokens; `mask` selects active tokens. Returns (loss, stats)."""
    mask = mask.to(torch.float32)
    n = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    loss = -(surrogate * mask).sum() / n
    stats = {"clip_frac": float((((ratio - 1).abs() > clip_eps).float() * mask).sum() / n),
             "ratio_mean": float((ratio.detach() * mask).sum() / n)}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        log_r = ref_logprobs - logprobs
        k3 = torch.exp(log_r) - log_r - 1
        kl = (k3 * mask).sum() / n
        loss = loss + kl_coef * kl
        stats["kl"] = float(kl.detach())
    stats["pg_loss"] = float(loss.detach())
    return loss, stats
