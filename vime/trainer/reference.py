"""FALLBACK trainer: Qwen3Reference (every op rl_kernel, differentiable) with fp32 master weights and
torch AdamW. Used only when `trainer.engine=reference`; it is labelled in the logs and metrics. It is a
`vime.engines.Trainer`, and the GRPO step (`vime.trainer.grpo`) drives it as a `PolicyModel`.

The forward runs in the checkpoint dtype on the model's own tensors (so its logprobs are exactly
the ones a strict rollout engine computes); gradients land on those tensors and are copied to the
fp32 masters, which the optimizer updates and which are rounded back into the model after the step.
"""

from __future__ import annotations

import math

import torch

from rl_kernel.models.qwen3 import Qwen3Reference
from vime.config.schema import TrainerConfig
from vime.errors import ConfigError
from vime.trainer import grpo

LABEL = "reference (FALLBACK: Qwen3Reference + torch AdamW, not Megatron)"


class Forward:
    """The teacher-forcing forward of a `Qwen3Reference` as the GRPO step wants it: packed sequences in,
    the logprobs of the requested rows out (one process: no ranks to gather from)."""

    def __init__(self, model: Qwen3Reference, truncation=None):
        self.model = model
        self.truncation = truncation  # rl_kernel.ops.truncation.Truncation the logprobs are renormalised under

    def forward_logprobs(
        self,
        ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        targets: torch.Tensor,
        temps: torch.Tensor,
        rows: torch.Tensor,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprobs, rows), and with `entropy` (logprobs, rows, full-vocab entropy) from the same pass."""
        dev = self.model.device
        hidden = self.model.forward_packed(ids.to(dev), cu_seqlens.to(dev))
        rows_d = rows.to(dev)
        out = self.model.logprobs(
            hidden[rows_d],
            targets.to(dev)[rows_d],
            temps.to(dev)[rows_d],
            truncation=self.truncation,
            with_entropy=entropy,
        )
        return (out[0], rows, out[1]) if entropy else (out, rows)

    def gather_logprobs(self, values: torch.Tensor, index: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(int(cu_seqlens[-1]), dtype=torch.float32)
        full[index] = values.detach().to("cpu", torch.float32)
        return full


class ReferenceTrainer:
    label = LABEL

    def __init__(
        self, cfg: TrainerConfig, model_path: str, dtype: str, device: str, loss: grpo.LossConfig, truncation=None
    ):
        if cfg.tp != 1 or cfg.cp != 1:
            raise ConfigError(
                f"trainer.tp={cfg.tp}, trainer.cp={cfg.cp}: the reference fallback trainer runs "
                "TP1/CP1 only; use trainer.engine=megatron for model parallelism"
            )
        self.cfg, self.loss, self.micro_batch_size = cfg, loss, cfg.micro_batch_size or None
        self.model = Qwen3Reference.from_pretrained(model_path, dtype=getattr(torch, dtype), device=device)
        self.vocab_size = self.model.config.vocab_size
        self.ref = (
            Forward(Qwen3Reference.from_pretrained(model_path, dtype=getattr(torch, dtype), device=device))
            if loss.kl_coef > 0
            else None
        )
        self.params = self._tensors(self.model)
        self.master = [torch.nn.Parameter(p.detach().to(torch.float32).clone()) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self._forward = Forward(self.model, truncation)

    @staticmethod
    def _tensors(m: Qwen3Reference) -> list[torch.Tensor]:
        ts = [m.embed, m.norm] + ([] if m.lm_head is m.embed else [m.lm_head])
        return ts + [t for layer in m.layers for t in layer.values()]

    def set_modes(self, modes: dict[str, str]) -> None:
        """Nothing to do: this trainer runs in the actor's process, whose rl_kernel modes are set."""

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float):
        """Teacher-forcing fp32 logprobs of the response tokens, per sequence, and their positions."""
        logprobs = grpo.score(self, sequences, prompt_lens, temperature, self.micro_batch_size)
        return logprobs, [list(range(p, len(s))) for s, p in zip(sequences, prompt_lens)]

    def train_step(self, batch: grpo.TrainBatch) -> dict[str, float]:
        if self.loss.kl_in_loss:  # with algo.kl_in_reward the KL went into the rewards (`reference_kl`)
            batch.ref_logprobs = grpo.score(
                self.ref, batch.sequences, batch.prompt_lens, batch.temperature, self.micro_batch_size
            )
        return grpo.train_step(self, batch, self.loss, self.micro_batch_size)

    # ---- grpo.PolicyModel ------------------------------------------------------------------------

    def forward_logprobs(self, ids, cu_seqlens, targets, temps, rows, entropy=False):
        return self._forward.forward_logprobs(ids, cu_seqlens, targets, temps, rows, entropy)

    def gather_logprobs(self, values, index, cu_seqlens):
        return self._forward.gather_logprobs(values, index, cu_seqlens)

    def zero_grad(self) -> None:
        for p in self.params:
            p.requires_grad_(True)
            p.grad = None

    def reduce_metrics(self, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
        return sums | maxes  # one rank

    def optimizer_step(self) -> float | None:
        """Gradients to the fp32 masters, clipping at `grad_clip`, AdamW, masters rounded back into the model."""
        for master, p in zip(self.master, self.params):
            master.grad = p.grad.to(torch.float32) if p.grad is not None else torch.zeros_like(master)
            p.requires_grad_(False)
            p.grad = None
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master, self.cfg.grad_clip or float("inf")))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, p in zip(self.master, self.params):
                p.copy_(master)
        return grad_norm

    def save(self, path) -> None:
        """Model tensors, fp32 masters and AdamW state (torch.save; this fallback is TP1, one file)."""
        torch.save(
            {
                "params": [p.detach().clone() for p in self.params],
                "master": [m.detach() for m in self.master],
                "optimizer": self.optimizer.state_dict(),
            },
            f"{path}/reference_trainer.pt",
        )

    def load(self, path) -> None:
        state = torch.load(f"{path}/reference_trainer.pt", weights_only=False)
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"]):
                p.copy_(saved)
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])

    def load_scoring_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """Put HF-named weights into the model for scoring (in place; the fp32 masters are not touched)."""
        self.model.load_hf_weights(hf, strict=True)

    def export_hf(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        return {k: v.detach().to(device) for k, v in self.model.state_dict_hf().items()}
