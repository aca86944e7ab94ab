"""GRPO, the algorithm: group-normalised advantages, the clipped policy loss, and the training step and
teacher-forcing scoring over any differentiable policy engine (`PolicyModel`: Megatron-core through
`rl_kernel.integrations.megatron.MegatronPolicy`, or the reference fallback). Pure torch.

Advantages: within each group (the samples of one prompt) A_i = (r_i - mean(r)) / (std(r) + eps),
std unbiased (as torch.std); a group whose rewards are all equal gets A = 0 exactly.

Loss, per active token t (mask 1): ratio = exp(logp - old_logp); the clipped surrogate
pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)); with `kl_coef` > 0 the k3
estimator of KL(pi || ref), kl = exp(ref - logp) - (ref - logp) - 1, is added as kl_coef * kl.
The loss is sum(mask * (pg + kl_coef * kl)) / normalizer, where the normalizer defaults to the
number of active tokens; the step passes the batch's total so micro-batches add up to the batch mean.
`clip_frac` is the standard (PPO / verl) one: the fraction of active tokens whose clipped branch is
active, i.e. where -A * clip(ratio) > -A * ratio (the clipped term wins the max and has no gradient).

Off-policy corrections (the asynchronous loop; `LossConfig.correction`): the behaviour policy mu is the
rollout (its recorded logprobs, reproduced in bits by the trainer under the weight versions that produced
them), the proximal policy is the trainer's current weights (the step's own forward, detached), and the
importance weight of a token is w = exp(logp_prox - logp_mu): pure staleness, no numerical noise. The
PPO ratio is then taken against the proximal policy and the token's term is multiplied by a function of
w: `decoupled` w, masked above `is_cap` (decoupled PPO as in AReaL); `tis` min(w, is_cap) (truncated
importance sampling); `icepop` w inside [icepop_low, icepop_high], else 0 (IcePop). `none` is the
synchronous loss above. Every mode reports w's mean and max over active tokens and the share of tokens
the correction changed (`is_clip_frac`), and counts the tokens of samples produced entirely by the
current weights whose w is not exactly 1.0 (`lag0_ratio_off`; 0 whenever the bits agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from rl_kernel.bits import bits
from rl_kernel.models.packing import Packed, pack
from vime.errors import TrainingError


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


CORRECTION_NAMES = ("none", "decoupled", "tis", "icepop")


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    correction: str = "none"  # CORRECTION_NAMES: see the module docstring
    is_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    entropy_coef: float = 0.0  # loss -= entropy_coef * token mean of the full-vocab entropy (see `entropy_term`)

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0:
            raise ValueError(f"clip_low, clip_high and kl_coef must be >= 0, got {self}")
        if self.correction not in CORRECTION_NAMES:
            raise ValueError(f"correction {self.correction!r} does not exist; use one of {', '.join(CORRECTION_NAMES)}")


def behaviour_weight(w: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss weight of each token, where the correction changed w) for importance weights
    w = pi_prox / pi_behaviour [N] (detached), under `config.correction` (not `none`)."""
    if config.correction == "tis":
        altered = w > config.is_cap
        return torch.clamp(w, max=config.is_cap), altered
    if config.correction == "decoupled":
        altered = w > config.is_cap
    elif config.correction == "icepop":
        altered = (w < config.icepop_low) | (w > config.icepop_high)
    else:
        raise ValueError(f"no behaviour weight for correction {config.correction!r}")
    return torch.where(altered, torch.zeros_like(w), w), altered


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig = LossConfig(),
    ref_logprobs: torch.Tensor | None = None,
    normalizer: float | None = None,
    fresh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of the clipped policy-gradient objective; all inputs [N] per token, fp32.
    `old_logprobs` are the behaviour (rollout) logprobs; `fresh` marks the tokens of samples produced
    entirely by the weights `logprobs` are computed with (their w must be exactly 1.0).

    metrics (detached sums over active tokens, to be divided by the token count by the caller):
    pg_sum, kl_sum (when kl_coef > 0), clipped (tokens whose clipped branch is active), ratio_sum, tokens,
    is_ratio_sum / is_ratio_max (w = pi_prox / pi_behaviour), is_clipped (tokens the correction changed),
    lag0_ratio_off / lag0_tokens (fresh tokens whose w is not exactly 1.0 / all fresh tokens)."""
    shapes = {t.shape for t in (logprobs, old_logprobs, advantages, mask)}
    if len(shapes) != 1 or logprobs.dim() != 1:
        raise ValueError(f"logprobs, old_logprobs, advantages and mask must all be [N]; got {shapes}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
    mask = mask.to(logprobs.dtype)
    behaviour = old_logprobs.to(logprobs.dtype)
    is_ratio = torch.exp(logprobs.detach() - behaviour)  # pi_prox / pi_behaviour
    weight = None
    if config.correction != "none":
        weight, altered = behaviour_weight(is_ratio, config)
        old_logprobs = logprobs.detach()  # the PPO ratio against the proximal policy
    log_ratio = logprobs - old_logprobs.to(logprobs.dtype)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if weight is not None:
        per_token = per_token * weight
    active = mask.bool()
    fresh_active = active if fresh is None else active & fresh.to(active.device).bool()
    metrics = {
        "pg_sum": (per_token * mask).sum().detach(),
        "clipped": ((clipped > unclipped).to(mask.dtype) * mask).sum().detach(),
        "ratio_sum": (ratio * mask).sum().detach(),
        "tokens": mask.sum().detach(),
        "is_ratio_sum": (is_ratio * mask).sum(),
        "is_ratio_max": is_ratio[active].max() if bool(active.any()) else torch.zeros(()),
        "is_clipped": (altered & active).sum() if weight is not None else torch.zeros(()),
        "lag0_ratio_off": ((is_ratio != 1.0) & fresh_active).sum(),
        "lag0_tokens": fresh_active.sum(),
    }
    if config.kl_coef > 0:
        delta = ref_logprobs.to(logprobs.dtype) - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_coef * kl
        metrics["kl_sum"] = (kl * mask).sum().detach()
    denom = float(mask.sum()) if normalizer is None else float(normalizer)
    if denom <= 0:
        raise ValueError("no active tokens (mask is all zero and no normalizer given)")
    return (per_token * mask).sum() / denom, metrics


def entropy_term(
    entropy: torch.Tensor, mask: torch.Tensor, config: LossConfig, normalizer: float, metrics: dict
) -> torch.Tensor:
    """The entropy bonus -entropy_coef * sum(mask * H) / normalizer (a 0 without gradient when entropy_coef is
    0), H [N] the full-vocab entropy (nats) of each token's policy distribution; adds `entropy_sum` (detached
    sum over active tokens) to `metrics`."""
    mask = mask.to(entropy.dtype)
    metrics["entropy_sum"] = (entropy.detach() * mask).sum()
    if config.entropy_coef == 0:
        return torch.zeros((), dtype=entropy.dtype, device=entropy.device)
    return -config.entropy_coef * (entropy * mask).sum() / float(normalizer)


@dataclass
class TrainBatch:
    """One optimizer step's samples. Per sequence i: token ids, prompt length, advantage, and the
    fp32 logprobs of its response tokens j >= prompt_lens[i] under the behaviour policy (rollout),
    optionally under a reference policy (for the KL term)."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    advantages: list[float]
    old_logprobs: list[torch.Tensor]
    ref_logprobs: list[torch.Tensor] | None = None
    temperature: float = 1.0
    keep_logprobs: bool = False  # return the training forward's logprobs (train_step's "logprobs")
    fresh: list[bool] | None = None  # per sequence: produced entirely by the current weights (None: all)


class PolicyModel(Protocol):
    """What the GRPO step needs from a differentiable policy engine (every rank of a model-parallel
    engine calls these collectively with the same arguments)."""

    def forward_logprobs(
        self,
        ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        targets: torch.Tensor,
        temps: torch.Tensor,
        rows: torch.Tensor,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher-forcing fp32 logprobs (differentiable under grad mode) of packed rows: (values, the row
        indices they belong to). The rows computed on this rank include every row of `rows` it owns. With
        `entropy`: (values, rows, the full-vocab entropy of each row's distribution), from the same LM-head pass.
        Under an exact top-k / top-p truncation a token outside its support has logprob -inf."""

    def gather_logprobs(self, values: torch.Tensor, index: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """[T] logprobs of every row from the ranks' `forward_logprobs` results (the same on every rank)."""

    def zero_grad(self) -> None:
        """Start a step: training mode, gradients cleared."""

    def reduce_metrics(self, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
        """Sum `sums` and take the max of `maxes` over the ranks that split the tokens; merged dict."""

    def optimizer_step(self) -> float | None:
        """Finish the step (gradient reductions, clipping, update); the gradient norm, or None when the
        gradients are not finite (nothing updated)."""


def micro_batches(n: int, size: int | None) -> list[range]:
    size = size or n
    return [range(a, min(n, a + size)) for a in range(0, n, size)]


def score(
    model: PolicyModel,
    sequences: list[list[int]],
    prompt_lens: list[int],
    temperature: float | list[float] = 1.0,
    micro_batch_size: int | None = None,
) -> list[torch.Tensor]:
    """Teacher-forcing fp32 logprobs: entry i holds log p(sequences[i][j] | sequences[i][:j]) at the
    sequence's temperature, for j in [prompt_lens[i], len(sequences[i])). Micro-batches of
    `micro_batch_size` sequences are packed (varlen); the bits do not depend on the packing."""
    temps = [temperature] * len(sequences) if isinstance(temperature, int | float) else list(temperature)
    if len(temps) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(temps)} temperatures")
    out: list[torch.Tensor] = []
    for mb in micro_batches(len(sequences), micro_batch_size):
        p = pack([sequences[i] for i in mb], [prompt_lens[i] for i in mb])
        with torch.no_grad():
            values, index = model.forward_logprobs(
                p.ids, p.cu_seqlens, p.targets, p.per_row([temps[i] for i in mb]), p.rows
            )
            full = model.gather_logprobs(values, index, p.cu_seqlens)
        out.extend(full[p.rows].split(p.counts))
    return out


def _micro_batch_loss(
    model: PolicyModel,
    p: Packed,
    batch: TrainBatch,
    mb: range,
    config: LossConfig,
    total_tokens: int,
    sums: dict[str, float],
    maxes: dict[str, float],
    kept: list[torch.Tensor],
) -> None:
    """Forward, loss and backward of one micro-batch; adds its metrics to `sums` / `maxes` and, when
    `batch.keep_logprobs`, its sequences' response logprobs (fp32, the forward's own values) to `kept`."""
    old = p.on_rows([batch.old_logprobs[i] for i in mb])
    adv = p.on_rows([float(batch.advantages[i]) for i in mb])
    mask = p.on_rows([1.0] * len(mb))
    ref = None if batch.ref_logprobs is None else p.on_rows([batch.ref_logprobs[i] for i in mb])
    fresh = p.on_rows([1.0 if batch.fresh is None or batch.fresh[i] else 0.0 for i in mb])
    temps = p.per_row([batch.temperature] * len(mb))
    lp, index, entropy = model.forward_logprobs(p.ids, p.cu_seqlens, p.targets, temps, p.rows, entropy=True)
    old, adv, mask, fresh = (t[index].to(lp.device) for t in (old, adv, mask, fresh))
    ref = None if ref is None else ref[index].to(lp.device)
    loss, m = policy_loss(lp, old, adv, mask, config, ref, normalizer=total_tokens, fresh=fresh)
    loss = loss + entropy_term(entropy, mask, config, total_tokens, m)
    loss.backward()
    if batch.keep_logprobs:
        kept.extend(model.gather_logprobs(lp.detach(), index, p.cu_seqlens)[p.rows].split(p.counts))
    active = mask.bool()
    sums["outside_support"] += float((torch.isneginf(lp.detach()) & active).sum())
    mine, theirs = lp.detach()[active], old[active]
    diff = mine - theirs
    sums["loss"] += float(loss.detach())
    for key in (
        "pg_sum",
        "clipped",
        "ratio_sum",
        "tokens",
        "kl_sum",
        "is_ratio_sum",
        "is_clipped",
        "lag0_ratio_off",
        "lag0_tokens",
        "entropy_sum",
    ):
        sums[key] += float(m.get(key, 0.0))
    maxes["is_ratio_max"] = max(maxes["is_ratio_max"], float(m["is_ratio_max"]))
    sums["mismatch_count"] += float((bits(mine) != bits(theirs)).sum())
    sums["abs_diff_sum"] += float(diff.abs().sum())
    maxes["max_abs_diff"] = max(maxes["max_abs_diff"], float(diff.abs().max()) if diff.numel() else 0.0)


def train_step(model: PolicyModel, batch: TrainBatch, config: LossConfig, micro_batch_size: int | None = None) -> dict:
    """One optimizer step of the clipped policy-gradient loss over the whole batch (token mean over all
    response tokens, summed over micro-batches and ranks). Returns metrics, including the agreement of
    the trainer's train-mode logprobs with the old (rollout) ones on every response token (before the
    update), and with `batch.keep_logprobs` those logprobs themselves under "logprobs" (one fp32 tensor
    per sequence, as `score` returns them: the same bits in strict mode, from the forward the step
    needs anyway). A non-finite loss or gradient raises TrainingError and leaves the weights unchanged."""
    n = len(batch.sequences)
    if not (len(batch.prompt_lens) == len(batch.advantages) == len(batch.old_logprobs) == n):
        raise ValueError("sequences, prompt_lens, advantages and old_logprobs must have one entry per sequence")
    total_tokens = sum(len(s) - p for s, p in zip(batch.sequences, batch.prompt_lens))
    model.zero_grad()
    sums = dict.fromkeys(
        (
            "loss",
            "pg_sum",
            "clipped",
            "ratio_sum",
            "tokens",
            "kl_sum",
            "mismatch_count",
            "abs_diff_sum",
            "is_ratio_sum",
            "is_clipped",
            "lag0_ratio_off",
            "lag0_tokens",
            "entropy_sum",
            "outside_support",
        ),
        0.0,
    )
    maxes = {"max_abs_diff": 0.0, "is_ratio_max": 0.0}
    kept: list[torch.Tensor] = []
    for mb in micro_batches(n, micro_batch_size):
        p = pack([batch.sequences[i] for i in mb], [batch.prompt_lens[i] for i in mb])
        _micro_batch_loss(model, p, batch, mb, config, total_tokens, sums, maxes, kept)
    sums = model.reduce_metrics(sums, maxes)
    if sums["outside_support"]:
        raise TrainingError(
            f"{sums['outside_support']:.0f} sampled token(s) lie outside the trainer's top-k / top-p / min-p support "
            "(a consistency failure: the rollout and the trainer cut different supports); nothing was updated"
        )
    if not math.isfinite(sums["loss"]):
        raise TrainingError(f"non-finite loss {sums['loss']}: lower trainer.lr or check the rewards / advantages")
    grad_norm = model.optimizer_step()
    if grad_norm is None:
        raise TrainingError(
            "non-finite gradients (the optimizer step was skipped): lower trainer.lr or check the rewards / advantages"
        )
    tokens = max(sums["tokens"], 1.0)
    return {
        "loss": sums["loss"],
        "pg_loss": sums["pg_sum"] / tokens,
        "clip_frac": sums["clipped"] / tokens,
        "ratio_mean": sums["ratio_sum"] / tokens,
        "kl": sums["kl_sum"] / tokens,
        "tokens": sums["tokens"],
        "grad_norm": grad_norm,
        "mismatch_count": sums["mismatch_count"],
        "max_abs_diff": sums["max_abs_diff"],
        "mean_abs_diff": sums["abs_diff_sum"] / tokens,
        "is_ratio_mean": sums["is_ratio_sum"] / tokens,
        "is_ratio_max": sums["is_ratio_max"],
        "is_clip_frac": sums["is_clipped"] / tokens,
        "lag0_ratio_off": sums["lag0_ratio_off"],
        "lag0_tokens": sums["lag0_tokens"],
        "entropy": sums["entropy_sum"] / tokens,
    } | ({"logprobs": kept} if batch.keep_logprobs else {})
