"""What the RL loop exchanges with its engines: the `Sample` a rollout produces, the `Scored` result of
the trainer's teacher forcing, and the `Rollout` and `Trainer` protocols that the vLLM, Megatron and
reference engines implement (the Ray actors in `vime.rollout.actor` / `vime.trainer.actor` host one
engine each and speak `Sample` / `Scored` to the driver).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from vime.trainer.grpo import TrainBatch


@dataclasses.dataclass
class Sample:
    """One rollout sample: a response to one prompt, with what produced each of its tokens."""

    group: int  # prompt index within the step (a GRPO group)
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # rollout logprob of each response token (fp32 values)
    versions: list[int]  # weight version that produced each response token
    engine: int  # rollout engine id
    temperature: float
    top_k: int = -1  # the exact truncation it sampled under (rl_kernel.ops.truncation; -1 / 0, 1.0, 0.0: off)
    top_p: float = 1.0
    min_p: float = 0.0
    vocab_size: int = 0  # real vocab range the engine normalised over
    finish_reason: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    # MoE models: int16 [fed positions, MoE layers, k] expert ids the engine routed each fed position to (ascending;
    # -1 where the engine did not compute it, a prefix-cache hit); None for a dense model or an engine that cannot say
    routes: torch.Tensor | None = None


@dataclasses.dataclass
class Scored:
    """The trainer's teacher-forcing logprobs for one sample, with what it scored."""

    token_ids: list[int]  # the response token ids it scored
    positions: list[int]  # their positions in the sequence (prompt_len + j)
    logprobs: torch.Tensor  # fp32 [len(token_ids)]
    version: int  # weight version of the trainer's weights
    temperature: float
    vocab_size: int
    versions: list[int] = dataclasses.field(default_factory=list)  # per token, when re-scored under behaviour
    # versions (vime/loop/async_loop.py)
    top_k: int = -1  # the exact truncation it scored under (rl_kernel.ops.truncation; -1 / 1.0 / 0.0: off)
    top_p: float = 1.0
    min_p: float = 0.0
    routes: torch.Tensor | None = None  # MoE: int16 [sequence positions, MoE layers, k] expert ids of its forward


def one_temperature(samples: list[Sample]) -> float:
    """The temperature all `samples` were drawn at (a step, a re-scoring pass: one temperature each)."""
    temps = {s.temperature for s in samples}
    if len(temps) != 1:
        raise ValueError(f"samples must share one temperature, got {sorted(temps)}")
    return temps.pop()


# (response token ids, fp32 logprobs as floats, weight version per token) of one prompt
Generated = tuple[list[int], list[float], list[int]]


class Rollout(Protocol):
    """A rollout engine (`vime.rollout.vllm_engine.VllmRollout`, `vime.rollout.reference.ReferenceRollout`)."""

    label: str
    vocab_size: int
    version: int  # the weight version it serves
    top_k: int  # its sampling parameters, recorded on every sample (the gate checks them)
    top_p: float

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_token_ids: list[int], seed: int
    ) -> list[Generated]: ...

    def rescore(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float
    ) -> list[list[float]]: ...

    def set_modes(self, modes: dict[str, str]) -> None: ...

    def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None: ...

    def set_version(self, version: int) -> int: ...

    def evidence(self, reset: bool = False) -> list[dict]: ...

    def shutdown(self) -> None: ...


class Trainer(Protocol):
    """A trainer rank (`vime.trainer.megatron_engine.MegatronTrainer`, `vime.trainer.reference.ReferenceTrainer`);
    the loss settings (clip_eps, kl_coef) are fixed when it is built."""

    label: str
    vocab_size: int

    def score(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float
    ) -> tuple[list[torch.Tensor], list[list[int]]]: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...

    def set_modes(self, modes: dict[str, str]) -> None: ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...

    def export_hf(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]: ...

    def load_scoring_weights(self, hf: dict[str, torch.Tensor]) -> None: ...
