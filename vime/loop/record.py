"""The record of one step, typed: what metrics.jsonl, W&B, the console, the figure and the checkpoint read.

A `StepRecord` holds one group per concern, and each group is a W&B panel group (`consistency/...`,
`rollout/...`): the key names are the groups' field names, written once here. `row()` is the flat dict
of metrics.jsonl (one key per field, `lag_share_<k>` per lag); `StepRecord.from_row` reads it back and
refuses a key no group declares, so a new metric is a new field, not a new spelling somewhere else. A
metric a step did not measure (the asynchronous loop's, or a row of an older run) is None: left out of
the row, shown as '-'.
Units: seconds (`*_s`), bytes (`sync_bytes`), GB/s (`sync_gbps`), weight versions (`version`, lags).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


@dataclass
class Parity:
    """Rollout vs trainer logprobs of the step's active response tokens (fp32 bit patterns)."""

    tokens: int = 0
    mismatch_count: int = 0
    max_abs_diff: float = 0.0
    mean_abs_diff: float = 0.0
    outside_support: int = 0  # sampled tokens outside the trainer's top-k / top-p support (refused)
    # the worst token, when any differs
    worst_sample: int | None = None
    worst_index: int | None = None  # the token's index in its sample's response
    worst_position: int | None = None
    worst_token_id: int | None = None
    worst_rollout: float | None = None
    worst_trainer: float | None = None
    worst_abs_diff: float | None = None
    # MoE: (token, MoE layer) routes whose expert set differs between rollout and trainer (share, count, of compared)
    routing_mismatch: float | None = None
    routing_mismatch_count: int | None = None
    routes_compared: int | None = None
    # the training forward against the same rollout logprobs (trainer.scoring_pass: a separate forward)
    train_mismatch_count: float | None = None
    train_max_abs_diff: float | None = None
    train_mean_abs_diff: float | None = None


@dataclass
class Rollout:
    """The step's samples: rewards in [0, 1], GRPO groups whose rewards all tie, response length in tokens."""

    reward_mean: float = 0.0
    reward_std: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    tied_groups: int = 0
    correct_frac: float = 0.0
    response_len_mean: float = 0.0
    # the synchronous loop's sampling (vime/loop/sampling.py): prompt batches the step sampled, tied groups
    # algo.dynamic_sampling dropped, prompts consumed by the run so far (the data position); algo.kl_in_reward:
    # the mean reward penalty kl_coef x summed KL
    sample_rounds: int | None = None
    dropped_groups: int | None = None
    prompts_consumed: int | None = None
    kl_penalty_mean: float | None = None


@dataclass
class Response:
    """How the step's responses ended: the share cut at algo.max_new_tokens (no stop token)."""

    truncated_frac: float | None = None


@dataclass
class Reward:
    """The reward function's side (vime/data/reward_pool.py): samples whose call failed under
    reward.on_error=zero (scored 0), and the step's mean of each extra value a dict-returning function gave
    (`extras[name]`: row key and W&B key `reward/<name>`)."""

    reward_errors: int | None = None
    extras: dict[str, float] = field(default_factory=dict)


@dataclass
class Train:
    """The trainer's update: the loss and its parts, the PPO ratio's mean and clipped share, the gradient norm."""

    loss: float | None = None
    pg_loss: float | None = None
    clip_frac: float | None = None
    ratio_mean: float | None = None
    kl: float | None = None
    grad_norm: float | None = None
    updates: int | None = None  # optimizer steps of the step (algo.mini_batches x ppo_epochs)
    first_ratio_off: float | None = None  # tokens of the first update whose ratio is not exactly 1 (must be 0)
    entropy: float | None = None  # token mean of the policy's full-vocab entropy (nats), from the training pass
    # CUDA: GiB rank 0's allocator reached during the step, and what it still holds after giving its cache back
    # (vime.trainer.actor.release_cached_memory: what a colocated vLLM finds taken when it wakes)
    trainer_gpu_peak_gib: float | None = None
    trainer_gpu_held_gib: float | None = None


@dataclass
class Timing:
    """Wall-clock seconds of the step's phases and of the whole step."""

    rollout_s: float | None = None
    score_s: float | None = None
    train_s: float | None = None
    sync_s: float | None = None
    sleep_s: float | None = None  # colocated vLLM's sleep before the trainer's work (inside score_s)
    wake_s: float | None = None  # its wake-up before the weight push (between train_s and sync_s)
    step_s: float | None = None


@dataclass
class Weights:
    """Weight versions (before and after the step's update) and the sync that moved the new one."""

    version: int = 0
    next_version: int = 0
    sync_bytes: float | None = None
    sync_buckets: float | None = None
    sync_gbps: float | None = None
    sync_transports: list[str] | None = None


@dataclass
class OffPolicy:
    """Staleness (in weight versions behind the trainer) and the off-policy correction's ratios."""

    staleness_mean: float | None = None
    staleness_max: int | None = None
    lag_share: dict[int, float] = field(default_factory=dict)  # share of tokens k versions behind
    is_ratio_mean: float | None = None
    is_ratio_max: float | None = None
    is_clip_frac: float | None = None
    lag0_ratio_off: float | None = None  # tokens of the current weights whose ratio is not exactly 1 (must be 0)
    lag0_tokens: float | None = None
    # the asynchronous loop only
    rollout_staleness_max: int | None = None
    stale_groups: int | None = None
    requeued_groups: int | None = None
    mixed_samples: int | None = None
    stale_samples: int | None = None
    behaviour_checked_tokens: int | None = None
    behaviour_check_rate: float | None = None


@dataclass
class StepRecord:
    """One step of a run. `samples`: (prompt, completion, reward) of a few samples, for people to read;
    `contracts`: the rl_kernel contract verdict per boundary; the engine labels name what ran."""

    step: int
    consistency: Parity = field(default_factory=Parity)
    rollout: Rollout = field(default_factory=Rollout)
    train: Train = field(default_factory=Train)
    timing: Timing = field(default_factory=Timing)
    weights: Weights = field(default_factory=Weights)
    offpolicy: OffPolicy = field(default_factory=OffPolicy)
    response: Response = field(default_factory=Response)
    reward: Reward = field(default_factory=Reward)
    samples: list = field(default_factory=list)
    contracts: dict[str, str] = field(default_factory=dict)
    strict: bool = False
    engine_restarts: int = 0
    rollout_engine: str = ""
    trainer_engine: str = ""

    GROUPS: ClassVar[tuple[str, ...]] = (
        "consistency",
        "rollout",
        "train",
        "timing",
        "weights",
        "offpolicy",
        "response",
        "reward",
    )

    def row(self) -> dict[str, Any]:
        """The flat row of metrics.jsonl: every field by its name (a group's unset optional fields left
        out), `lag_share_<k>` per lag, non-finite floats as strings (JSON has none)."""
        out: dict[str, Any] = {"step": self.step}
        for name in self.GROUPS:
            group = getattr(self, name)
            for f in fields(group):
                value = getattr(group, f.name)
                if f.name == "lag_share":
                    out |= {f"lag_share_{k}": v for k, v in sorted(value.items())}
                elif f.name == "extras":
                    out |= {f"reward/{k}": _jsonable(v) for k, v in sorted(value.items())}
                elif value is not None:
                    out[f.name] = _jsonable(value)
        return out | {
            "samples": self.samples,
            "contracts": self.contracts,
            "strict": self.strict,
            "engine_restarts": self.engine_restarts,
            "rollout_engine": self.rollout_engine,
            "trainer_engine": self.trainer_engine,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> StepRecord:
        """The record of a flat row (`row()`'s inverse, or the metrics a step gathered); a key no group
        declares raises ValueError naming it."""
        groups = {name: {} for name in cls.GROUPS}
        top, shares, extras = {}, {}, {}
        for key, value in row.items():
            if key.startswith("lag_share_"):
                shares[int(key.removeprefix("lag_share_"))] = float(value)
            elif key.startswith("reward/"):
                extras[key.removeprefix("reward/")] = float(_number(value))
            elif key in _OWNER:
                groups[_OWNER[key]][key] = _number(value)
            elif key in _TOP:
                top[key] = value
            else:
                raise ValueError(f"step metric {key!r} is not a field of vime.loop.record.StepRecord: declare it there")
        groups["offpolicy"]["lag_share"] = shares
        groups["reward"]["extras"] = extras
        return cls(**top, **{name: _GROUP_TYPES[name](**values) for name, values in groups.items()})

    def wandb(self) -> dict[str, float]:
        """The numeric metrics under their W&B group (`consistency/mismatch_count`, `offpolicy/lag_share_0`)."""
        out = {}
        for key, value in self.row().items():
            group = "offpolicy" if key.startswith("lag_share_") else _OWNER.get(key)
            if key.startswith("reward/") and isinstance(value, int | float):
                out[key] = value
            elif group and isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{group}/{key.removeprefix('reward_') if group == 'reward' else key}"] = value
        return out


@dataclass(frozen=True)
class RunFacts:
    """What every step record of a run carries beside the step's own measurements: the GRPO group size, the
    tokenizer's `decode` (for the sample completions), whether every boundary is strict, the engine labels."""

    group_size: int
    decode: Callable[[Sequence[int]], str]
    strict: bool
    labels: dict[str, str]


def step_record(
    step: int,
    versions: tuple[int, int],
    samples: Sequence,
    times: tuple[float, float, float, float],
    run: RunFacts,
    engine_restarts: int,
    measured: dict[str, Any],
) -> StepRecord:
    """The record of step `step`, the one row builder of both loops (`vime.loop.driver`, `vime.loop.async_loop`).

    `versions`: (the weight version the step sampled at, the trainer's after its update); `samples`: the step's
    samples with their rewards (their reward statistics and a few completions go in the row); `times`: the
    perf_counter seconds (start, rollout done, scored, trained), each phase's duration and the step's (to now)
    taken from them; `measured`: the step's own metrics (parity, trainer stats, sync, staleness, rewards,
    contracts, the loop's extras), each a field of a group above."""
    import torch  # here, not at import: the config checks that import this module come before the heavy imports

    rewards = torch.tensor([s.reward for s in samples])  # float32, as the rewards' statistics always were
    t0, t1, t2, t3 = times
    row = {
        "step": step,
        "version": versions[0],
        "next_version": versions[1],
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "reward_min": float(rewards.min()),
        "reward_max": float(rewards.max()),
        "tied_groups": tied_groups(rewards.tolist(), run.group_size),
        "correct_frac": float((rewards == 1.0).float().mean()),
        "samples": completion_lines(samples, run.decode, 4, start=step),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        **measured,
        "rollout_s": t1 - t0,
        "score_s": t2 - t1,
        "train_s": t3 - t2,
        "step_s": time.perf_counter() - t0,
        "strict": run.strict,
        "engine_restarts": engine_restarts,
        **run.labels,
    }
    return StepRecord.from_row(row)


def tied_groups(rewards: Sequence[float], group_size: int) -> int:
    """How many GRPO groups have all-equal rewards (advantage exactly 0: no learning signal)."""
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return sum(1 for g in groups if max(g) == min(g))


def completion_lines(samples: Sequence, decode, n: int = 2, start: int = 0) -> list[tuple[str, str, float]]:
    """(prompt text, response text, reward) of `n` samples from different groups, the first from
    group `start` (mod the number of groups) onwards, so successive steps show different prompts."""
    seen, out = set(), []
    groups = sorted({s.group for s in samples})
    first = groups[start % len(groups)] if groups else 0
    for s in sorted(samples, key=lambda x: ((x.group - first) % max(1, len(groups)), x.group)):
        if s.group in seen:
            continue
        seen.add(s.group)
        out.append((decode(s.prompt_ids), decode(s.response_ids), float(s.reward)))
        if len(out) == n:
            break
    return out


def _jsonable(value: Any) -> Any:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _number(value: Any) -> Any:
    """A float that JSON carried as a string ('nan', 'inf') back to a float; anything else as it is."""
    return float(value) if isinstance(value, str) and value in ("nan", "inf", "-inf") else value


_GROUP_TYPES = {
    "consistency": Parity,
    "rollout": Rollout,
    "train": Train,
    "timing": Timing,
    "weights": Weights,
    "offpolicy": OffPolicy,
    "response": Response,
    "reward": Reward,
}
_OWNER = {
    f.name: name
    for name, cls in _GROUP_TYPES.items()
    for f in dataclasses.fields(cls)
    if f.name not in ("lag_share", "extras")
}
_TOP = {f.name for f in fields(StepRecord)} - set(StepRecord.GROUPS)
