"""The policy-gradient algorithm: advantages (`vime.trainer.advantages`), the clipped policy loss, and the
training step and teacher-forcing scoring over any differentiable policy engine (`PolicyModel`: Megatron-core
through `rl_kernel.integrations.megatron.MegatronPolicy`, or the reference fallback). Pure torch.

Loss (`policy_loss`), per active token t (mask 1) of sequence i with advantage A:
- `ppo` (`LossConfig.policy_loss`): ratio = exp(logp - old_logp); pg = max(-A * ratio, -A * clip(ratio,
  1 - clip_low, 1 + clip_high)) (DAPO's clip-higher: clip_high > clip_low).
- `gspo` (GSPO): the sequence ratio s_i = exp(mean_t(logp - old_logp)) replaces the token ratio, clipped
  to [1 - gspo_clip_low, 1 + gspo_clip_high]. It is computed in GSPO's token form, ratio_t =
  sg[s_i] * exp(logp_t - sg[logp_t]): the value of every token is s_i, and with a mean over each sequence's
  tokens (`loss_agg=seq_mean_token_mean`, the paper's) value and gradient are GSPO's; the sequence mean is
  taken over every rank's tokens of the sequence (context parallelism splits them).
- dual clip (`clip_c` > 1, off when None): where A < 0 the term is also bounded by -A * clip_c.
- KL to the initial policy with `kl_coef` > 0: kl_coef * kl (`vime.trainer.losses.kl_penalty`, estimator
  `kl_estimator`) is added to the token's term, unless `kl_in_reward` (the driver then subtracts
  kl_coef * sum_t kl from the sample's reward before the advantages, and the loss has no KL term).
The batch loss aggregates the terms by `loss_agg` (`vime.trainer.losses.aggregation`); micro-batches each
add their share over the same denominator, so their sum is the batch value. An `entropy_coef` term would be
one more addition to the token's term before aggregation.
`clip_frac` is the standard (PPO / verl) one: the fraction of active tokens whose clipped branch is
active, i.e. where -A * clip(ratio) > -A * ratio (the clipped term wins the max and has no gradient).

Several updates per rollout batch (`mini_batches` optimizer steps over consecutive slices of the batch, for
`ppo_epochs` passes): the behaviour logprobs stay the rollout's. With mini_batches > 1 the step first scores
the whole batch without gradients under its starting weights (the step's first forward: its logprobs are the
ones compared with the rollout's and returned as "logprobs"); with mini_batches 1 the first pass's forward
is that forward. Those step-start logprobs are the proximal policy of the corrections below. The first
update's ratio is exactly 1.0 on every token whenever the bits agree; `first_ratio_off` counts the tokens
where it is not.

Off-policy corrections (the asynchronous loop; `LossConfig.correction`): the behaviour policy mu is the
rollout (its recorded logprobs, reproduced in bits by the trainer under the weight versions that produced
them), the proximal policy is the trainer's weights at the start of the step (the step's first forward,
detached), and the importance weight of a token is w = exp(logp_prox - logp_mu): pure staleness, no
numerical noise. The PPO ratio is then taken against the proximal policy and the token's term is multiplied
by a function of w: `decoupled` w, masked above `is_cap` (decoupled PPO as in AReaL); `tis` min(w, is_cap)
(truncated importance sampling); `icepop` w inside [icepop_low, icepop_high], else 0 (IcePop). `none` is the
synchronous loss above. Under `gspo` the weight is the sequence's, w_i = exp(mean_t(logp_prox - logp_mu)),
for every token of the sequence: then w_i times the proximal sequence ratio is exactly GSPO's sequence ratio
against mu (the means add), and a per-token weight would bring back the token-level variance GSPO removes.
Every mode reports w's (per token) mean and max over active tokens and the share of tokens the correction
changed (`is_clip_frac`), and counts the tokens of samples produced entirely by the current weights whose w
is not exactly 1.0 (`lag0_ratio_off`; 0 whenever the bits agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rl_kernel.bits import bits
from rl_kernel.models.packing import Packed, pack
from vime.errors import TrainingError
from vime.trainer.advantages import group_advantages  # noqa: F401 - the algorithm's public name
from vime.trainer.losses import KL_ESTIMATORS, LOSS_AGGS, aggregation, kl_penalty

CORRECTION_NAMES = ("none", "decoupled", "tis", "icepop")
POLICY_LOSSES = ("ppo", "gspo")


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    correction: str = "none"  # CORRECTION_NAMES: see the module docstring
    is_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    policy_loss: str = "ppo"  # POLICY_LOSSES
    gspo_clip_low: float = 3e-4  # the GSPO paper's range of the sequence ratio
    gspo_clip_high: float = 4e-4
    clip_c: float | None = None  # dual clip (> 1); None: off
    kl_estimator: str = "k3"  # vime.trainer.losses.KL_ESTIMATORS
    kl_in_reward: bool = False  # the KL is a reward penalty (the driver's), not a loss term
    loss_agg: str = "token_mean"  # vime.trainer.losses.LOSS_AGGS
    loss_norm_tokens: float | None = None  # seq_mean_token_sum_norm's constant
    mini_batches: int = 1  # optimizer steps per pass over the batch
    ppo_epochs: int = 1  # passes over the batch
    entropy_coef: float = 0.0  # loss -= entropy_coef * token mean of the full-vocab entropy (see `entropy_term`)

    def __post_init__(self) -> None:
        if min(self.clip_low, self.clip_high, self.gspo_clip_low, self.gspo_clip_high, self.kl_coef) < 0:
            raise ValueError(f"clip ranges and kl_coef must be >= 0, got {self}")
        if self.correction not in CORRECTION_NAMES:
            raise ValueError(f"correction {self.correction!r} does not exist; use one of {', '.join(CORRECTION_NAMES)}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss {self.policy_loss!r} does not exist; use one of {', '.join(POLICY_LOSSES)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator {self.kl_estimator!r} does not exist; use one of {', '.join(KL_ESTIMATORS)}"
            )
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg {self.loss_agg!r} does not exist; use one of {', '.join(LOSS_AGGS)}")
        if self.loss_agg == "seq_mean_token_sum_norm" and not (self.loss_norm_tokens or 0) > 0:
            raise ValueError("loss_agg seq_mean_token_sum_norm needs loss_norm_tokens > 0")
        if self.clip_c is not None and not self.clip_c > 1.0:
            raise ValueError(f"clip_c must be > 1 (or None: no dual clip), got {self.clip_c}")
        if self.mini_batches < 1 or self.ppo_epochs < 1:
            raise ValueError(f"mini_batches and ppo_epochs must be >= 1, got {self.mini_batches}, {self.ppo_epochs}")

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward


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
    scale: torch.Tensor | None = None,
    prox_logprobs: torch.Tensor | None = None,
    seq_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of the clipped policy-gradient objective; all inputs [N] per token, fp32.
    `old_logprobs` are the behaviour (rollout) logprobs; `prox_logprobs` the proximal policy's (the step's
    starting weights, detached; None: `logprobs` themselves, the step's first update); `fresh` marks the tokens
    of samples produced entirely by the weights `logprobs` are computed with (their w must be exactly 1.0).
    The loss is sum(mask * scale * term) / normalizer (`scale` default 1, `normalizer` default the number of
    active tokens: the token mean). `seq_mean` (needed by gspo) maps a detached per-token tensor to the mean
    over each token's sequence, broadcast back to its tokens (`vime.trainer.losses.local_seq_mean`).

    metrics (detached sums over active tokens, to be divided by the token count by the caller):
    pg_sum, kl_sum (when the KL is a loss term), clipped (tokens whose clipped branch is active), ratio_sum,
    ratio_off (tokens whose ratio is not exactly 1.0), tokens, is_ratio_sum / is_ratio_max (w = pi_prox /
    pi_behaviour), is_clipped (tokens the correction changed), lag0_ratio_off / lag0_tokens (fresh tokens whose
    w is not exactly 1.0 / all fresh tokens)."""
    shapes = {t.shape for t in (logprobs, old_logprobs, advantages, mask)}
    if len(shapes) != 1 or logprobs.dim() != 1:
        raise ValueError(f"logprobs, old_logprobs, advantages and mask must all be [N]; got {shapes}")
    if config.kl_in_loss and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
    gspo = config.policy_loss == "gspo"
    if gspo and seq_mean is None:
        raise ValueError("policy_loss gspo needs seq_mean (the mean over each token's sequence)")
    mask = mask.to(logprobs.dtype)
    behaviour = old_logprobs.to(logprobs.dtype)
    prox = logprobs.detach() if prox_logprobs is None else prox_logprobs.to(logprobs.dtype)
    is_ratio = torch.exp(prox - behaviour)  # pi_prox / pi_behaviour
    weight = None
    base = behaviour
    if config.correction != "none":
        w = torch.exp(seq_mean(prox - behaviour)) if gspo else is_ratio
        weight, altered = behaviour_weight(w, config)
        base = prox  # the ratio against the proximal policy
    if gspo:  # value s_i on every token of sequence i, gradient s_i * dlogp_t
        log_ratio = seq_mean(logprobs.detach() - base) + (logprobs - logprobs.detach())
        low, high = config.gspo_clip_low, config.gspo_clip_high
    else:
        log_ratio = logprobs - base
        low, high = config.clip_low, config.clip_high
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if config.clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * config.clip_c), per_token)
    if weight is not None:
        per_token = per_token * weight
    active = mask.bool()
    fresh_active = active if fresh is None else active & fresh.to(active.device).bool()
    metrics = {
        "pg_sum": (per_token * mask).sum().detach(),
        "clipped": ((clipped > unclipped).to(mask.dtype) * mask).sum().detach(),
        "ratio_sum": (ratio * mask).sum().detach(),
        "ratio_off": ((ratio.detach() != 1.0) & active).sum(),
        "tokens": mask.sum().detach(),
        "is_ratio_sum": (is_ratio * mask).sum(),
        "is_ratio_max": is_ratio[active].max() if bool(active.any()) else torch.zeros(()),
        "is_clipped": (altered & active).sum() if weight is not None else torch.zeros(()),
        "lag0_ratio_off": ((is_ratio != 1.0) & fresh_active).sum(),
        "lag0_tokens": fresh_active.sum(),
    }
    if config.kl_in_loss:
        kl = kl_penalty(logprobs, ref_logprobs, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        metrics["kl_sum"] = (kl * mask).sum().detach()
    denom = float(mask.sum()) if normalizer is None else float(normalizer)
    if denom <= 0:
        raise ValueError("no active tokens (mask is all zero and no normalizer given)")
    if scale is not None:
        per_token = per_token * scale.to(logprobs.dtype)
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


SUM_KEYS = (
    "pg_sum",
    "clipped",
    "ratio_sum",
    "tokens",
    "kl_sum",
    "mismatch_count",
    "abs_diff_sum",
    "compared",
    "is_ratio_sum",
    "is_clipped",
    "is_tokens",
    "lag0_ratio_off",
    "lag0_tokens",
    "first_ratio_off",
    "entropy_sum",
    "outside_support",
)


def mini_batches(n: int, count: int) -> list[range]:
    """`count` consecutive slices of range(n), as even as possible (the first ones one longer)."""
    if not 1 <= count <= n:
        raise ValueError(f"cannot split {n} sequences into {count} mini-batches")
    size, extra = divmod(n, count)
    bounds = [0]
    for k in range(count):
        bounds.append(bounds[-1] + size + (k < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass
class _Update:
    """One optimizer step of `train_step`: its sequences' aggregation, where its metrics go, and what it is
    (`first`: the step's first update; `counted`: its tokens' first pass, which the once-per-token metrics
    count; `compare`: its forward is the step's first of these sequences, compared with the rollout's)."""

    scale: dict[int, float]  # sequence -> aggregation scale
    denom: float
    first: bool
    counted: bool
    compare: bool
    prox: list[torch.Tensor] | None  # the step-start logprobs of every sequence (None: this forward's own)
    sums: dict[str, float]
    maxes: dict[str, float]
    kept: dict[int, torch.Tensor]  # sequence -> its logprobs from this update's forward, when wanted
    keep: bool
    loss: float = 0.0  # this rank's share of the update's loss
    outside: float = 0.0  # this rank's compared tokens outside the trainer's truncated support


def _rank_seq_mean(model: PolicyModel, p: Packed, index: torch.Tensor):
    """`policy_loss`'s seq_mean over the packed sequences of `p`, whose rows this rank holds at `index` (the
    sequence means take every rank's rows: `gather_logprobs` is collective)."""

    def seq_mean(values: torch.Tensor) -> torch.Tensor:
        full = model.gather_logprobs(values.detach(), index, p.cu_seqlens)
        means = [float(chunk.mean()) if chunk.numel() else 0.0 for chunk in full[p.rows].split(p.counts)]
        return p.on_rows(means)[index].to(values.device, values.dtype)

    return seq_mean


def _micro_batch_loss(model: PolicyModel, p: Packed, batch: TrainBatch, mb: range, config: LossConfig, u: _Update):
    """Forward, loss and backward of one micro-batch of update `u`; adds its metrics to `u.sums` / `u.maxes`
    and, when `u.keep`, its sequences' response logprobs (fp32, the forward's own values) to `u.kept`."""
    old = p.on_rows([batch.old_logprobs[i] for i in mb])
    adv = p.on_rows([float(batch.advantages[i]) for i in mb])
    mask = p.on_rows([1.0] * len(mb))
    scale = p.on_rows([u.scale[i] for i in mb])
    with_ref = batch.ref_logprobs is not None and config.kl_in_loss
    ref = p.on_rows([batch.ref_logprobs[i] for i in mb]) if with_ref else None
    prox = None if u.prox is None else p.on_rows([u.prox[i] for i in mb])
    fresh = p.on_rows([1.0 if batch.fresh is None or batch.fresh[i] else 0.0 for i in mb])
    temps = p.per_row([batch.temperature] * len(mb))
    lp, index, entropy = model.forward_logprobs(p.ids, p.cu_seqlens, p.targets, temps, p.rows, entropy=True)
    old, adv, mask, fresh, scale = (t[index].to(lp.device) for t in (old, adv, mask, fresh, scale))
    # rows outside the responses carry no loss; under a top-k / top-p truncation their target (a prompt token) may
    # lie outside the support (-inf), and GSPO's token form (lp - lp.detach()) would make that a NaN
    lp = torch.where(mask.bool(), lp, torch.zeros_like(lp))
    ref = None if ref is None else ref[index].to(lp.device)
    prox = None if prox is None else prox[index].to(lp.device)
    seq_mean = _rank_seq_mean(model, p, index) if config.policy_loss == "gspo" else None
    loss, m = policy_loss(
        lp, old, adv, mask, config, ref, u.denom, fresh, scale=scale, prox_logprobs=prox, seq_mean=seq_mean
    )
    loss = loss + entropy_term(entropy, mask * scale, config, u.denom, m)
    loss.backward()
    if u.keep:
        full = model.gather_logprobs(lp.detach(), index, p.cu_seqlens)[p.rows].split(p.counts)
        u.kept.update(zip(mb, full))
    s = u.sums
    u.loss += float(loss.detach())
    for key in ("pg_sum", "clipped", "ratio_sum", "tokens", "kl_sum"):
        s[key] += float(m.get(key, 0.0))
    if u.first:
        s["first_ratio_off"] += float(m["ratio_off"])
    if u.counted:
        s["entropy_sum"] += float((entropy.detach() * mask).sum())
        for key in ("is_ratio_sum", "is_clipped", "lag0_ratio_off", "lag0_tokens"):
            s[key] += float(m[key])
        s["is_tokens"] += float(m["tokens"])
        u.maxes["is_ratio_max"] = max(u.maxes["is_ratio_max"], float(m["is_ratio_max"]))
    if u.compare:
        active = mask.bool()
        outside = float((torch.isneginf(lp.detach()) & active).sum())  # outside the trainer's truncated support
        s["outside_support"] += outside
        u.outside += outside
        _compare(lp.detach()[active], old[active], s, u.maxes)


def _compare(mine: torch.Tensor, theirs: torch.Tensor, sums: dict[str, float], maxes: dict[str, float]) -> None:
    """Add the bit agreement of the trainer's logprobs `mine` with the rollout's `theirs` to the metrics."""
    diff = mine - theirs
    sums["mismatch_count"] += float((bits(mine) != bits(theirs)).sum())
    sums["abs_diff_sum"] += float(diff.abs().sum())
    sums["compared"] += float(diff.numel())
    maxes["max_abs_diff"] = max(maxes["max_abs_diff"], float(diff.abs().max()) if diff.numel() else 0.0)


def _outside_support_message(count: float) -> str:
    return (
        f"{count:.0f} sampled token(s) lie outside the trainer's top-k / top-p / min-p support (a consistency "
        "failure: the rollout and the trainer cut different supports); nothing was updated"
    )


def _optimizer_step(model: PolicyModel, share: float, outside: float = 0.0) -> tuple[float, float]:
    """Finish one update whose loss on this rank is `share`: (its loss summed over the ranks, its gradient
    norm) after the optimizer step (collective; TrainingError on every rank when the loss or the gradients
    are not finite, or when `outside` tokens of a forward compared with the rollout lie outside the trainer's
    truncated support: nothing is updated)."""
    reduced = model.reduce_metrics({"loss": share, "outside": outside}, {"loss_share_max": share})
    loss = reduced["loss"]
    if reduced["outside"]:
        raise TrainingError(_outside_support_message(reduced["outside"]))
    if not math.isfinite(loss):
        raise TrainingError(f"non-finite loss {loss}: lower trainer.lr or check the rewards / advantages")
    grad_norm = model.optimizer_step()
    if grad_norm is None:
        raise TrainingError(
            "non-finite gradients (the optimizer step was skipped): lower trainer.lr or check the rewards / advantages"
        )
    return loss, grad_norm


def train_step(model: PolicyModel, batch: TrainBatch, config: LossConfig, micro_batch_size: int | None = None) -> dict:
    """`config.ppo_epochs` passes over the batch, each `config.mini_batches` optimizer steps of the clipped
    policy-gradient loss (aggregated by `config.loss_agg` over each mini-batch, summed over its micro-batches
    and ranks). Returns metrics: loss and grad_norm the mean over the updates, the token metrics over every
    update's tokens, the off-policy ones (is_*, lag0_*) over each token once; the agreement of the trainer's
    logprobs with the old (rollout) ones on every response token from the step's first forward of it (before
    any update), and with `batch.keep_logprobs` those logprobs themselves under "logprobs" (one fp32 tensor
    per sequence, as `score` returns them: the same bits in strict mode, from a forward the step needs anyway);
    `first_ratio_off`, the tokens of the first update whose ratio is not exactly 1.0. A non-finite loss or
    gradient raises TrainingError and leaves the weights of that update unchanged."""
    n = len(batch.sequences)
    if not (len(batch.prompt_lens) == len(batch.advantages) == len(batch.old_logprobs) == n):
        raise ValueError("sequences, prompt_lens, advantages and old_logprobs must have one entry per sequence")
    lengths = [len(s) - p for s, p in zip(batch.sequences, batch.prompt_lens)]
    sums = dict.fromkeys(SUM_KEYS, 0.0)
    maxes = {"max_abs_diff": 0.0, "is_ratio_max": 0.0}
    start = None  # the step-start logprobs of every sequence (the proximal policy of later updates)
    scored = dict.fromkeys(("mismatch_count", "abs_diff_sum", "compared"), 0.0) | {"max_abs_diff": 0.0}
    if config.mini_batches > 1:  # later mini-batches' first forwards come after an update: score them all now
        start = score(model, batch.sequences, batch.prompt_lens, batch.temperature, micro_batch_size)
        for lp, old in zip(start, batch.old_logprobs):  # the same on every rank: added after the reduction
            _compare(lp, old.to(lp.dtype), scored, scored)
        outside = sum(float(torch.isneginf(lp).sum()) for lp in start)
        if outside:
            raise TrainingError(_outside_support_message(outside))
    slices = mini_batches(n, config.mini_batches)
    losses, norms = [], []
    for epoch in range(config.ppo_epochs):
        kept: dict[int, torch.Tensor] = {}
        for part in slices:
            scale, denom = aggregation([lengths[i] for i in part], config.loss_agg, config.loss_norm_tokens)
            u = _Update(
                dict(zip(part, scale)),
                denom,
                first=not losses,
                counted=epoch == 0,
                compare=start is None and epoch == 0,
                prox=start,
                sums=sums,
                maxes=maxes,
                kept=kept,
                keep=start is None and epoch == 0 and (batch.keep_logprobs or config.ppo_epochs > 1),
            )
            model.zero_grad()
            for mb in micro_batches_of(part, micro_batch_size):
                p = pack([batch.sequences[i] for i in mb], [batch.prompt_lens[i] for i in mb])
                _micro_batch_loss(model, p, batch, mb, config, u)
            loss, grad_norm = _optimizer_step(model, u.loss, u.outside)
            losses.append(loss)
            norms.append(grad_norm)
        if start is None and kept:
            start = [kept[i] for i in range(n)]
    sums = model.reduce_metrics(sums, maxes)
    for key in ("mismatch_count", "abs_diff_sum", "compared"):
        sums[key] += scored[key]
    sums["max_abs_diff"] = max(sums["max_abs_diff"], scored["max_abs_diff"])
    tokens = max(sums["tokens"], 1.0)
    is_tokens = max(sums["is_tokens"], 1.0)
    return {
        "loss": sum(losses) / len(losses),
        "pg_loss": sums["pg_sum"] / tokens,
        "clip_frac": sums["clipped"] / tokens,
        "ratio_mean": sums["ratio_sum"] / tokens,
        "kl": sums["kl_sum"] / tokens,
        "tokens": sums["is_tokens"],
        "grad_norm": sum(norms) / len(norms),
        "updates": len(losses),
        "first_ratio_off": sums["first_ratio_off"],
        "mismatch_count": sums["mismatch_count"],
        "max_abs_diff": sums["max_abs_diff"],
        "mean_abs_diff": sums["abs_diff_sum"] / max(sums["compared"], 1.0),
        "is_ratio_mean": sums["is_ratio_sum"] / is_tokens,
        "is_ratio_max": sums["is_ratio_max"],
        "is_clip_frac": sums["is_clipped"] / is_tokens,
        "lag0_ratio_off": sums["lag0_ratio_off"],
        "lag0_tokens": sums["lag0_tokens"],
        "entropy": sums["entropy_sum"] / tokens,
        "outside_support": sums["outside_support"],
    } | ({"logprobs": start} if batch.keep_logprobs else {})


def micro_batches_of(part: range, size: int | None) -> list[range]:
    """Consecutive micro-batches of at most `size` sequences of the slice `part` (None: all of it)."""
    return [range(part.start + r.start, part.start + r.stop) for r in micro_batches(len(part), size)]
