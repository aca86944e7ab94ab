"""Megatron-core trainer rank: `rl_kernel.integrations.megatron.MegatronPolicy` (strict: rl_kernel's
layer spec; native: Megatron's own modules; per-boundary modes: rl_kernel's layer spec with the
native boundaries running rl_kernel's native forms) on one rank of a TP x CP torch.distributed world
(gloo on CPU, NCCL on CUDA) that the trainer actors form among themselves."""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from vime.config import Mode, TrainerConfig, modes_label, side_modes
from vime.errors import TrainingError


class MegatronTrainer:
    def __init__(self, cfg: TrainerConfig, model_path: str, dtype: str, device: str, kl_coef: float, clip_eps: float,
                 rank: int, world_size: int, init_method: str):
        import megatron.core

        from rl_kernel.integrations.megatron import MegatronPolicy, PolicyLossConfig

        if device == "cuda":
            torch.cuda.set_device(0)  # Ray gives each trainer actor its own GPU (CUDA_VISIBLE_DEVICES)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size,
                                    init_method=init_method,
                                    timeout=datetime.timedelta(minutes=10))
        modes = side_modes(cfg.mode, cfg.boundary_modes)
        mode = Mode(cfg.mode).value if not cfg.boundary_modes else modes
        self.label = f"megatron-core {megatron.core.__version__} ({modes_label(modes)}, tp={cfg.tp}, cp={cfg.cp})"
        make = lambda: MegatronPolicy(  # noqa: E731
            model_path, tp=cfg.tp, cp=cfg.cp, mode=mode, lr=cfg.lr,
            weight_decay=cfg.weight_decay, clip_grad=cfg.grad_clip,
            loss=PolicyLossConfig(clip_low=clip_eps, clip_high=clip_eps, kl_coef=kl_coef),
            micro_batch_size=cfg.micro_batch_size or None, dtype=getattr(torch, dtype), device=device)
        self.policy = make()
        self.ref = make() if kl_coef > 0 else None  # frozen initial policy for the KL term
        self.vocab_size = self.policy.shape.vocab_size

    def set_modes(self, modes: dict[str, str]) -> None:
        """Per-boundary modes of later forwards (`vime.audit` flips one boundary at a time)."""
        self.policy.set_modes(modes)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float):
        logprobs = self.policy.logprobs(sequences, prompt_lens, temperature)
        return logprobs, [list(range(p, len(s))) for s, p in zip(sequences, prompt_lens)]

    def train_step(self, sequences, prompt_lens, temperature: float, old_logprobs: list[torch.Tensor],
                   advantages: list[float], clip_eps: float, kl_coef: float) -> dict[str, float]:
        from rl_kernel.integrations.megatron import TrainBatch

        ref = self.ref.logprobs(sequences, prompt_lens, temperature) if self.ref is not None else None
        batch = TrainBatch(sequences, prompt_lens, advantages, old_logprobs, ref, temperature)
        try:
            stats = self.policy.train_step(batch)
        except RuntimeError as e:
            if "non-finite" in str(e):
                raise TrainingError(f"{e}: lower trainer.lr or check the rewards / advantages") from e
            raise
        if not math.isfinite(stats["loss"]):
            raise TrainingError(f"non-finite loss {stats['loss']}: lower trainer.lr or check the rewards / advantages")
        # The policy also compares its train-mode forward with the old (rollout) logprobs: a second,
        # independent measurement, logged as train_*.
        out = {k: v for k, v in stats.items() if k not in ("mismatch_count", "max_abs_diff", "mean_abs_diff",
                                                             "tokens", "step")}
        out |= {f"train_{k}": stats[k] for k in ("mismatch_count", "max_abs_diff", "mean_abs_diff") if k in stats}
        return out

    def save(self, path) -> None:
        """Model + optimizer in Megatron's distributed checkpoint format (collective)."""
        from vime.checkpoint import save_megatron

        save_megatron(self.policy, path)

    def load(self, path) -> None:
        from vime.checkpoint import load_megatron

        load_megatron(self.policy, path)

    def export_hf(self) -> dict[str, torch.Tensor]:
        return self.policy.export_hf_state_dict()
