"""Mixed-version re-scoring in the trainer: the logprobs of a sample whose tokens were produced under
several weight versions (an in-flight weight update, `rollout.partial`), reproduced as the rollout
engine computed them: rl_kernel's paged forward (`rl_kernel.models.rollout.mixed_version_logprobs`) over
the trainer's kept weights of each version, one run of positions per version over one KV cache."""

from __future__ import annotations

import torch

from rl_kernel.models.qwen3 import Qwen3Reference
from rl_kernel.models.rollout import mixed_version_logprobs
from vime.engines import Sample


class PagedScorer:
    """A `Qwen3Reference` (every op rl_kernel's, in this process's modes) that takes a version's HF-named
    weights before each run of positions."""

    def __init__(self, model_path: str, dtype: str, device: str):
        self.model = Qwen3Reference.from_pretrained(model_path, dtype=getattr(torch, dtype), device=device)
        self.loaded: int | None = None

    def score(self, sample: Sample, weights_of) -> torch.Tensor:
        """fp32 logprobs of `sample`'s response tokens under `sample.versions`; `weights_of(v)` gives
        version v's HF-named weights."""

        def load(version: int) -> None:
            if version != self.loaded:
                self.model.load_hf_weights(weights_of(version), strict=True)
                self.loaded = version

        return mixed_version_logprobs(
            self.model, sample.prompt_ids, sample.response_ids, sample.versions, sample.temperature, load
        )
