"""Advantage estimators (`algo.adv_estimator`): sequence-level rewards of GRPO groups -> one advantage per
sample, broadcast over its response tokens by the loss. Pure torch, float64 inside, fp32 out.

rewards is [num_groups, group_size] (group g = the samples of one prompt). Per group, with mean m and
unbiased std s (as torch.std) of its rewards r_1..r_G:
- `grpo`: A_i = (r_i - m) / (s + eps).
- `drgrpo` (Dr.GRPO): A_i = r_i - m (no std division: no per-group difficulty re-weighting).
- `rloo` (leave-one-out): A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - m).
- `reinforce_pp` (REINFORCE++ with a group baseline): b_i = r_i - m, then normalised over the whole batch:
  A_i = (b_i - mean(b)) / (std(b) + eps), every sample counting once (verl weights each by its token count).
A group whose rewards are all equal carries no signal: its A is exactly 0 under grpo / drgrpo / rloo (not
rounding noise or 0/0); under reinforce_pp its b is exactly 0 before the batch normalisation, and a batch whose
b are all equal gets A = 0 exactly.
"""

from __future__ import annotations

import torch

ADV_ESTIMATORS = {
    "grpo": "(r - group mean) / (group std + algo.adv_eps)",
    "drgrpo": "r - group mean (Dr.GRPO: no std division)",
    "rloo": "r - the mean of the other samples of the group (leave-one-out)",
    "reinforce_pp": "r - group mean, then normalised over the whole batch (REINFORCE++ baseline)",
}


def _checked(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, group_size >= 2], got {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite; a reward function returned NaN or inf")
    return r


def tied_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[num_groups] bool: the groups whose rewards are all equal (no learning signal)."""
    return rewards.amax(dim=1) == rewards.amin(dim=1)


def advantages(rewards: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_groups, group_size] -> advantages of the same shape (fp32), by `estimator`
    (ADV_ESTIMATORS; see the module docstring)."""
    r = _checked(rewards)
    tied = tied_groups(r).unsqueeze(1)
    mean = r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = (r - mean) / (r.std(dim=1, keepdim=True) + eps)
    elif estimator == "drgrpo":
        adv = r - mean
    elif estimator == "rloo":
        g = r.shape[1]
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)
    elif estimator == "reinforce_pp":
        b = torch.where(tied, 0.0, r - mean).flatten()
        if bool((b == b[0]).all()):
            return torch.zeros_like(r, dtype=torch.float32)
        std = b.std() if b.numel() > 1 else torch.zeros((), dtype=b.dtype)
        return ((b - b.mean()) / (std + eps)).reshape(r.shape).to(torch.float32)
    else:
        raise ValueError(f"adv_estimator {estimator!r} does not exist; use one of {', '.join(ADV_ESTIMATORS)}")
    return torch.where(tied, 0.0, adv).to(torch.float32)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised advantages (`advantages(rewards, "grpo", eps)`)."""
    return advantages(rewards, "grpo", eps)
