"""FALLBACK rollout engine: rl_kernel.models.rollout (paged KV, continuous batching, chunked prefill)
over Qwen3Reference. Used only when `rollout.engine=reference`; it is labelled as such in the logs
and in every step's metrics (`rollout_engine`)."""

from __future__ import annotations

import torch

import rl_kernel as rk
from rl_kernel.models.qwen3 import Qwen3Reference
from rl_kernel.models.qwen3_moe import capture_routes, moe_blocks, rollout_routes
from rl_kernel.models.rollout import DEFAULT_BLOCK_SIZE, Request, RolloutEngine
from vime.config.schema import RolloutConfig

LABEL = "reference (FALLBACK: rl_kernel.models.rollout, not vLLM)"


class ReferenceRollout:
    label = LABEL
    top_k, top_p = -1, 1.0  # samples from the full softmax (rl_kernel.models.rollout has no top-k / top-p)

    def __init__(self, cfg: RolloutConfig, model_path: str, dtype: str, device: str):
        self.cfg = cfg
        self.model = Qwen3Reference.from_pretrained(model_path, dtype=getattr(torch, dtype), device=device)
        self.vocab_size = self.model.config.vocab_size
        self.version = 0
        self._group = self._receiver = None  # the weight-push group (nccl) and receiver, from the first push
        self.last_routes: list | None = None  # MoE: each request's routes of the last `generate` (Sample.routes)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        seed: int,
        between_steps=None,
    ) -> list[tuple[list[int], list[float], list[int]]]:
        """Returns (response token ids, fp32 logprobs as floats, weight version per token) per prompt;
        request i samples from a generator seeded by (seed, i). `between_steps` (in-flight weight updates):
        `RolloutEngine.generate`'s hook, which may load a new version between engine steps."""
        engine = RolloutEngine(
            self.model,
            self.cfg.num_blocks,
            self.cfg.block_size or DEFAULT_BLOCK_SIZE,
            self.cfg.max_num_batched_tokens,
            block_seed=seed,
        )
        requests = [Request(p, max_new_tokens, temperature, stop_token_ids=tuple(stop_token_ids)) for p in prompts]
        with capture_routes(self.model.model) as captured:
            out = engine.generate(requests, seed=seed, between_steps=between_steps)
        lengths = [len(p) + len(c.token_ids) - 1 for p, c in zip(prompts, out)]
        self.last_routes = rollout_routes(engine.trace, captured, lengths) if moe_blocks(self.model.model) else None
        if between_steps is None:
            return [
                (c.token_ids, c.logprobs.to(torch.float32).tolist(), [self.version] * len(c.token_ids)) for c in out
            ]
        return [(c.token_ids, c.logprobs.to(torch.float32).tolist(), list(c.versions)) for c in out]

    def set_modes(self, modes: dict[str, str]) -> None:
        """Nothing to do: this engine runs in the actor's process, whose rl_kernel modes are set."""

    def rescore(self, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> list[list[float]]:
        """fp32 logprobs of fixed responses by teacher forcing (this fallback has no forced decode)."""
        from vime.trainer import grpo
        from vime.trainer.reference import Forward

        lp = grpo.score(
            Forward(self.model), [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts], temperature
        )
        return [t.to(torch.float32).tolist() for t in lp]

    def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_hf_weights(weights)

    def join_weight_group(self, host: str, port: int, rank: int, world: int) -> None:
        from rl_kernel.weights.transfer import open_weight_group, weight_store

        self._store = weight_store(host, world, port)
        self._group = open_weight_group(self._store, rank, world, self.model.device)
        self._receiver = None

    def receive_weights(self, msg: dict) -> dict | None:
        """`ipc` / `nccl` pushes (rl_kernel.weights.transfer): the receiver checks names, shapes,
        dtypes and that versions grow, and loads each bucket as it arrives."""
        from rl_kernel.weights.transfer import receiver_for_model

        if self._receiver is None:
            self._receiver = receiver_for_model(self.model, version=self.version, group=self._group, src=0)
        return self._receiver.handle(msg)

    def set_version(self, version: int) -> int:
        self.version = version
        return version

    def evidence(self, reset: bool = False) -> list[dict]:
        records = rk.evidence.snapshot()
        if reset:
            rk.evidence.reset()
        return records

    def shutdown(self) -> None:
        pass
