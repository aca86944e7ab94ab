"""Megatron-core trainer rank (a `vime.engines.Trainer`): rl_kernel's engine adapter
`rl_kernel.integrations.megatron.MegatronPolicy` (strict: rl_kernel's layer spec; native: Megatron's own
modules; per-boundary modes: rl_kernel's layer spec with the native boundaries running rl_kernel's
native forms) on one rank of a TP x CP torch.distributed world (gloo on CPU, NCCL on CUDA) that the
trainer actors form among themselves, driven by vime's GRPO scoring and training step
(`vime.trainer.grpo`)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from vime.config.schema import Mode, TrainerConfig, modes_label, side_modes
from vime.trainer import grpo


class MegatronTrainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        model_path: str,
        dtype: str,
        device: str,
        loss: grpo.LossConfig,
        rank: int,
        world_size: int,
        init_method: str,
        store=None,
        truncation=None,
    ):
        """`init_method` (or `store`, a torch Store that replaces it) is the trainer world's rendezvous."""
        import megatron.core

        from rl_kernel.integrations.megatron import MegatronPolicy

        if device == "cuda":
            torch.cuda.set_device(0)  # Ray gives each trainer actor its own GPU (CUDA_VISIBLE_DEVICES)
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo",
                rank=rank,
                world_size=world_size,
                init_method=None if store is not None else init_method,
                store=store,
                timeout=datetime.timedelta(minutes=10),
            )
        modes = side_modes(cfg.mode, cfg.boundary_modes)
        mode = Mode(cfg.mode).value if not cfg.boundary_modes else modes
        self.label = f"megatron-core {megatron.core.__version__} ({modes_label(modes)}, tp={cfg.tp}, cp={cfg.cp})"
        self.loss, self.micro_batch_size = loss, cfg.micro_batch_size or None
        make = lambda: MegatronPolicy(  # noqa: E731
            model_path,
            tp=cfg.tp,
            cp=cfg.cp,
            mode=mode,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            clip_grad=cfg.grad_clip,
            dtype=getattr(torch, dtype),
            device=device,
        )
        self.policy = make()
        self.policy.truncation = truncation  # exact top-k / top-p / min-p: every forward rebuilds the support
        self.ref = make() if loss.kl_coef > 0 else None  # frozen initial policy for the KL term
        self.vocab_size = self.policy.shape.vocab_size

    def set_modes(self, modes: dict[str, str]) -> None:
        """Per-boundary modes of later forwards (`vime.audit` flips one boundary at a time)."""
        self.policy.set_modes(modes)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float):
        logprobs = grpo.score(self.policy, sequences, prompt_lens, temperature, self.micro_batch_size)
        return logprobs, [list(range(p, len(s))) for s, p in zip(sequences, prompt_lens)]

    def train_step(self, batch: grpo.TrainBatch) -> dict[str, float]:
        if self.loss.kl_in_loss:  # with algo.kl_in_reward the KL went into the rewards (`reference_kl`)
            batch.ref_logprobs = grpo.score(
                self.ref, batch.sequences, batch.prompt_lens, batch.temperature, self.micro_batch_size
            )
        return grpo.train_step(self.policy, batch, self.loss, self.micro_batch_size)

    def save(self, path) -> None:
        """Model + optimizer in Megatron's distributed checkpoint format (collective)."""
        from vime.state.checkpoint import save_megatron

        save_megatron(self.policy, path)

    def load(self, path) -> None:
        from vime.state.checkpoint import load_megatron

        load_megatron(self.policy, path)

    def load_scoring_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """Put HF-named weights (a kept version, or the current one back) into the model for scoring; the
        optimizer's fp32 main params are not touched (collective under TP: each rank takes its shard)."""
        self.policy.load_hf_state_dict(hf, _reload_optimizer=False)

    def export_hf(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        return self.policy.export_hf_state_dict(device=device)
