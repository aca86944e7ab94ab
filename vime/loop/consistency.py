"""Rollout vs trainer logprob consistency: the comparability gate and the per-step metrics.

The gate runs first. It checks that the two sides computed the same quantity: same weight version,
same token ids at the same positions, same sampling semantics (temperature, the same exact top-k / top-p /
min-p truncation: `rl_kernel.ops.truncation`),
same vocab range, and the same numeric contracts for every op both sides ran strictly. A failed
gate raises `ComparabilityError`; it is never reported as a mismatch.

The metrics compare fp32 bit patterns (int32 views) on every active response token:
`mismatch_count`, `max_abs_diff`, `mean_abs_diff`, `tokens`, and the worst token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rl_kernel import BOUNDARIES, OP_BOUNDARY, contracts
from rl_kernel.bits import bits
from vime.engines import Sample, Scored
from vime.errors import ComparabilityError
from vime.loop import truncation


@dataclasses.dataclass
class Consistency:
    mismatch_count: int
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    worst: dict | None  # {sample, position, token_id, rollout, trainer, abs_diff}; None when all bits agree
    outside_support: int = 0  # sampled tokens the trainer's top-k / top-p support excludes (its logprob -inf)

    def metrics(self) -> dict[str, float | int]:
        m = {
            "mismatch_count": self.mismatch_count,
            "max_abs_diff": self.max_abs_diff,
            "mean_abs_diff": self.mean_abs_diff,
            "tokens": self.tokens,
            "outside_support": self.outside_support,
        }
        if self.worst is not None:
            m |= {f"worst_{k}": v for k, v in self.worst.items()}
        return m


def rollout_tensor(values: Sequence[float]) -> torch.Tensor:
    """Rollout logprobs as fp32, refusing values that are not exactly fp32 (bit comparison would lie)."""
    t64 = torch.tensor(list(values), dtype=torch.float64)
    t32 = t64.to(torch.float32)
    if not torch.equal(t32.to(torch.float64), t64):
        raise ComparabilityError(
            "rollout logprobs are not fp32 values (some change when rounded to fp32): "
            "the engine must return the fp32 logprobs it computed, not a rounded copy"
        )
    return t32


def compare(
    rollout: Sequence[torch.Tensor],
    trainer: Sequence[torch.Tensor],
    positions: Sequence[Sequence[int]] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
) -> Consistency:
    """Per-token comparison of fp32 logprobs, sample by sample (all tokens given are active).

    mismatch_count counts tokens whose fp32 bit patterns differ (so -0.0 vs 0.0 and NaNs count by
    bits); abs diffs are taken in fp64, a NaN's as inf (so `max_abs_diff` is inf, never 0.0, when a
    logprob is NaN; `mean_abs_diff` leaves NaN tokens out). The worst token is the mismatched one with the largest
    |diff| (the first one on ties); `positions` / `token_ids` label it when given.
    """
    if len(rollout) != len(trainer):
        raise ComparabilityError(f"{len(rollout)} rollout samples vs {len(trainer)} trainer samples")
    mismatches, tokens, diff_sum, worst, outside = 0, 0, 0.0, None, 0
    max_diff = 0.0
    for i, (a, b) in enumerate(zip(rollout, trainer)):
        if a.dtype != torch.float32 or b.dtype != torch.float32:
            raise ComparabilityError(f"sample {i}: logprobs must be fp32, got {a.dtype} and {b.dtype}")
        if a.shape != b.shape:
            raise ComparabilityError(f"sample {i}: {a.numel()} rollout logprobs vs {b.numel()} trainer logprobs")
        differ = bits(a) != bits(b)
        outside += int((torch.isneginf(b) & ~torch.isneginf(a)).sum())
        diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
        mismatches += int(differ.sum())
        tokens += a.numel()
        diff_sum += float(diff.nan_to_num(nan=0.0).sum())
        if a.numel():  # a NaN diff (a NaN on either side) is inf, as rl_kernel.bits.max_abs_diff has it:
            # Python's max(0.0, nan) would return 0.0 and hide it
            max_diff = max(max_diff, float(diff.nan_to_num(nan=float("inf")).max()))
        if bool(differ.any()):
            d = torch.where(differ, diff.nan_to_num(nan=float("inf")), torch.tensor(-1.0, dtype=torch.float64))
            j = int(d.argmax())
            if worst is None or float(d[j]) > worst["abs_diff"]:
                worst = {
                    "sample": i,
                    "index": j,
                    "position": int(positions[i][j]) if positions is not None else j,
                    "token_id": int(token_ids[i][j]) if token_ids is not None else -1,
                    "rollout": float(a[j]),
                    "trainer": float(b[j]),
                    "abs_diff": float(d[j]),
                }
    return Consistency(mismatches, max_diff, diff_sum / tokens if tokens else 0.0, tokens, worst, outside)


def refuse_outside_support(count: int, step: int) -> None:
    """A sampled token outside the trainer's support is a consistency failure, never dropped: raises
    ComparabilityError when step `step` counted any (`Consistency.outside_support`, logged first)."""
    if count:
        raise ComparabilityError(
            f"step {step}: {count} sampled token(s) lie outside the trainer's top-k / top-p / "
            "min-p support (the two sides cut different supports): the rollout and trainer disagree"
        )


def routing_agreement(samples: Sequence[Sample], scored: Sequence[Scored]) -> dict[str, float | int] | None:
    """MoE routes of the rollout vs the trainer: `routing_mismatch`, the share of (token, MoE layer) routes whose
    expert set differs, over the `routes_compared` (token, layer) pairs both sides recorded (every position the
    rollout fed itself: prompt and response but the last token, prefix-cache hits excepted). None when no sample
    has routes on both sides (a dense model, or an engine that does not record them). Expert ids are ascending
    per token on both sides, so equal sets are equal rows."""
    differ = compared = 0
    for i, (s, t) in enumerate(zip(samples, scored)):
        if s.routes is None or t.routes is None:
            continue
        fed = s.routes.shape[0]
        if t.routes.shape[0] < fed or t.routes.shape[1:] != s.routes.shape[1:]:
            raise ComparabilityError(
                f"sample {i}: rollout routes {tuple(s.routes.shape)} vs trainer routes {tuple(t.routes.shape)} "
                "([positions, MoE layers, k]): the two sides ran different MoE models"
            )
        known = (s.routes >= 0).all(-1)  # [positions, layers]
        same = (s.routes == t.routes[:fed]).all(-1)
        differ += int((known & ~same).sum())
        compared += int(known.sum())
    if compared == 0:
        return None
    return {"routing_mismatch": differ / compared, "routes_compared": compared, "routing_mismatch_count": differ}


def check_comparable(samples: Sequence[Sample], scored: Sequence[Scored], version: int) -> None:
    """The token-level gate: raises ComparabilityError naming the first sample that fails."""
    if len(samples) != len(scored):
        raise ComparabilityError(f"the trainer scored {len(scored)} samples, the rollout produced {len(samples)}")
    for i, (s, t) in enumerate(zip(samples, scored)):
        where = f"sample {i} (group {s.group}, engine {s.engine})"
        n = len(s.response_ids)
        if len(s.logprobs) != n or len(s.versions) != n:
            raise ComparabilityError(f"{where}: {n} tokens but {len(s.logprobs)} logprobs / {len(s.versions)} versions")
        stale = sorted({v for v in s.versions if v != version})
        if stale:
            raise ComparabilityError(
                f"{where}: tokens from weight versions {stale}, trainer is at version {version}: "
                "weights were not synced before the rollout"
            )
        if t.version != version:
            raise ComparabilityError(f"{where}: trainer scored with version {t.version}, expected {version}")
        if list(t.token_ids) != list(s.response_ids):
            raise ComparabilityError(f"{where}: the trainer scored other token ids than the rollout sampled")
        expected = list(range(len(s.prompt_ids), len(s.prompt_ids) + n))
        if list(t.positions) != expected:
            raise ComparabilityError(
                f"{where}: trainer scored positions {list(t.positions)}, the rollout's tokens are at {expected}"
            )
        if truncation.key(s.top_k, s.top_p, s.min_p) != truncation.key(t.top_k, t.top_p, t.min_p):
            raise ComparabilityError(
                f"{where}: drawn under top_k={s.top_k}, top_p={s.top_p}, min_p={s.min_p}, scored under "
                f"top_k={t.top_k}, top_p={t.top_p}, min_p={t.min_p}: the trainer must rebuild the rollout's "
                "truncation (algo.top_k / top_p / min_p reach both sides)"
            )
        if t.temperature != s.temperature:
            raise ComparabilityError(f"{where}: rollout temperature {s.temperature} vs trainer {t.temperature}")
        if t.vocab_size != s.vocab_size:
            raise ComparabilityError(f"{where}: rollout vocab range {s.vocab_size} vs trainer {t.vocab_size}")
        if t.logprobs.numel() != n:
            raise ComparabilityError(f"{where}: trainer returned {t.logprobs.numel()} logprobs for {n} tokens")


# Ops whose strict contracts are declared equal entry by entry: a rollout engine that samples from
# full-vocab strict log-probs (`log_softmax`) and a trainer that scores the chosen token (`logprobs`).
PAIRED_OPS = {"log_softmax": "logprobs", "logprobs": "log_softmax"}
# Ops that only pick the rollout's tokens (no value of theirs is recorded or recomputed): the engine's sampler.
SAMPLING_OPS = frozenset({"gumbel_sample"})


def contracts_by_op(records: Sequence[dict]) -> dict[str, set[tuple[str, str, str, str]]]:
    """Evidence records -> {op: {(mode, fingerprint, device_type, backend)}}."""
    out: dict[str, set[tuple[str, str, str, str]]] = {}
    for r in records:
        out.setdefault(r["op"], set()).add((r["mode"], r["fingerprint"], r["device_type"], r["backend"]))
    return out


def _check_side(side: str, records: Sequence[dict], modes: dict[str, str]) -> None:
    known = contracts.all_contracts()
    if any(modes[b] == "strict" for b in BOUNDARIES) and not records:
        raise ComparabilityError(
            f"the {side} reported no rl_kernel evidence although some of its boundaries are "
            "strict: its forward did not run rl_kernel ops (is the strict plugin on?)"
        )
    for r in records:
        boundary = OP_BOUNDARY.get(r["op"])
        if r["mode"] != "strict":
            if boundary is not None and modes[boundary] == "strict":
                raise ComparabilityError(
                    f"the {side} ran op {r['op']!r} natively although boundary {boundary!r} is strict"
                )
            continue
        mine = known.get(r["contract_id"])
        if mine is None or mine.fingerprint != r["fingerprint"]:
            raise ComparabilityError(
                f"the {side} ran {r['contract_id']} [{r['fingerprint']}], which this driver's "
                f"rl_kernel defines as [{mine.fingerprint if mine else 'unknown'}]: run the same "
                "rl_kernel version in every process"
            )


def check_contracts(
    rollout_records: Sequence[dict],
    trainer_records: Sequence[dict],
    rollout_modes: dict[str, str],
    trainer_modes: dict[str, str],
) -> dict[str, str]:
    """The contract gate on rl_kernel evidence. Each side: a boundary configured strict shows no native
    op, some evidence exists, and every strict contract it ran is the driver's rl_kernel's (same id,
    same fingerprint). Across sides, for each op both ran under strict boundaries, the (fingerprint,
    device type) sets are equal; a declared pair (`PAIRED_OPS`) must agree on backend and device type.
    A side that ran both ops of a pair records the values of the one both sides ran (rl_kernel's GPU
    rollout engine samples from `log_softmax` and records `logprobs`, as the trainer computes them); its
    other op only shaped the sampling distribution: 'sampling', as is a rollout-only op that picks tokens
    (`SAMPLING_OPS`: the engine's batch-invariant sampler).
    Returns {op: 'same' | 'paired' | 'sampling' | 'one-side' | 'native'}."""
    _check_side("rollout", rollout_records, rollout_modes)
    _check_side("trainer", trainer_records, trainer_modes)
    r_ops, t_ops = contracts_by_op(rollout_records), contracts_by_op(trainer_records)
    verdict = {}
    for op in sorted(set(r_ops) | set(t_ops)):
        boundary = OP_BOUNDARY.get(op)
        if boundary is None or rollout_modes[boundary] != "strict" or trainer_modes[boundary] != "strict":
            verdict[op] = "native"
        elif op in r_ops and op in t_ops:
            r = {(f, d) for _, f, d, _ in r_ops[op]}
            t = {(f, d) for _, f, d, _ in t_ops[op]}
            if r != t:
                raise ComparabilityError(
                    f"op {op!r}: rollout ran contracts {sorted(r)}, trainer ran {sorted(t)}: "
                    "both sides must run the same backend on the same device type"
                )
            verdict[op] = "same"
        elif op in SAMPLING_OPS and op not in t_ops:
            verdict[op] = "sampling"
        elif PAIRED_OPS.get(op) in r_ops and PAIRED_OPS[op] in t_ops:
            verdict[op] = "sampling"  # its side also ran the partner, which the other side ran too ('same' above)
        elif PAIRED_OPS.get(op) in (t_ops if op in r_ops else r_ops):
            mine, other = (r_ops, t_ops) if op in r_ops else (t_ops, r_ops)
            a = {(d, b) for _, _, d, b in mine[op]}
            b_ = {(d, b) for _, _, d, b in other[PAIRED_OPS[op]]}
            if a != b_:
                raise ComparabilityError(
                    f"ops {op!r} / {PAIRED_OPS[op]!r} ran on (device, backend) {sorted(a)} vs "
                    f"{sorted(b_)}: both sides must use the same backend on the same device type"
                )
            verdict[op] = "paired"
        else:
            verdict[op] = "one-side"  # e.g. all_reduce at trainer TP2 vs rollout TP1
    return verdict
