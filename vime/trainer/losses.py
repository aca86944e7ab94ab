"""The per-token pieces of the policy loss: KL estimators (`algo.kl_estimator`), loss aggregation
(`algo.loss_agg`) and sequence means (GSPO's sequence ratio). Pure torch.

KL estimators of KL(pi || ref) per token, with d = ref_logp - logp (Schulman's k1 / k2 / k3):
- `k1`: -d = log(pi / ref) (unbiased, high variance, can be negative);
- `k2`: d^2 / 2;
- `k3`: exp(d) - d - 1 (unbiased, >= 0; the default);
- `low_var_kl`: k3 with d clamped to [-20, 20] and the result to [-10, 10] (verl's `low_var_kl`: bounded
  where the policy has drifted far from the reference).

Loss aggregation: the loss of a batch (one optimizer step) of B sequences, sequence i with T_i active tokens
and per-token terms l_it, is
- `token_mean`: sum_it l_it / sum_i T_i (every token counts once);
- `seq_mean_token_mean`: (1/B) sum_i (1/T_i) sum_t l_it (every sequence counts once);
- `seq_mean_token_sum`: (1/B) sum_i sum_t l_it;
- `seq_mean_token_sum_norm`: (1/B) sum_i sum_t l_it / L, L = `algo.loss_norm_tokens` (Dr.GRPO's constant
  normaliser: no length bias; verl's form divides the batch's token sum by L only, a factor B apart).
Each is sum_it scale_i * l_it / denom with a per-sequence `scale` (1/T_i for seq_mean_token_mean, else 1) and
one `denom` for the batch (`aggregation`), so a micro-batch's share is its own sum over the same denom and the
shares add up to the batch value (as the token mean always did).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = {
    "k1": "log(pi / ref)",
    "k2": "(log(pi / ref))^2 / 2",
    "k3": "ref/pi - log(ref/pi) - 1 (default)",
    "low_var_kl": "k3, log-ratio clamped to [-20, 20] and result to [-10, 10] (verl)",
}

LOSS_AGGS = {
    "token_mean": "sum over the batch's tokens / their count",
    "seq_mean_token_mean": "mean over sequences of each sequence's token mean",
    "seq_mean_token_sum": "mean over sequences of each sequence's token sum",
    "seq_mean_token_sum_norm": "mean over sequences of token sum / algo.loss_norm_tokens (Dr.GRPO)",
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from logprobs of the sampled tokens (same shape, any float dtype)."""
    d = ref_logprobs.to(logprobs.dtype) - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    if estimator == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_estimator {estimator!r} does not exist; use one of {', '.join(KL_ESTIMATORS)}")


def aggregation(lengths: list[int], agg: str, norm_tokens: float | None = None) -> tuple[list[float], float]:
    """(per-sequence scale, denominator) of loss aggregation `agg` (LOSS_AGGS) over a batch of sequences with
    `lengths` active tokens each: the batch loss is sum_it scale_i * l_it / denom."""
    if not lengths:
        raise ValueError("aggregation over an empty batch")
    b = len(lengths)
    if agg == "token_mean":
        return [1.0] * b, float(sum(lengths))
    if agg == "seq_mean_token_mean":
        if min(lengths) < 1:
            raise ValueError(f"seq_mean_token_mean needs >= 1 token per sequence, got lengths {lengths}")
        return [1.0 / n for n in lengths], float(b)
    if agg == "seq_mean_token_sum":
        return [1.0] * b, float(b)
    if agg == "seq_mean_token_sum_norm":
        if norm_tokens is None or not norm_tokens > 0:
            raise ValueError(f"seq_mean_token_sum_norm needs a constant normaliser > 0, got {norm_tokens}")
        return [1.0] * b, float(b) * float(norm_tokens)
    raise ValueError(f"loss_agg {agg!r} does not exist; use one of {', '.join(LOSS_AGGS)}")


def local_seq_mean(seq_ids: torch.Tensor):
    """A `seq_mean` for tokens that hold every token of their sequences (one rank): maps a per-token tensor
    [N] to the mean over each token's sequence (`seq_ids` [N] int: which sequence a token belongs to),
    broadcast back to [N]."""
    ids = seq_ids.to(torch.long)
    n = int(ids.max()) + 1 if ids.numel() else 0

    def seq_mean(values: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, ids, values)
        counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, ids, torch.ones_like(values))
        return (sums / counts.clamp(min=1))[ids]

    return seq_mean
