"""FALLBACK trainer: Qwen3Reference (every op rl_kernel, differentiable) with fp32 master weights and
torch AdamW. Used only when `trainer.engine=reference`; it is labelled in the logs and metrics.

The forward runs in the checkpoint dtype on the model's own tensors (so its logprobs are exactly
the ones a strict rollout engine computes); gradients land on those tensors and are copied to the
fp32 masters, which the optimizer updates and which are rounded back into the model after the step.
"""

from __future__ import annotations

import torch

from rl_kernel.models.qwen3 import Qwen3Reference
from vime.config import TrainerConfig
from vime.errors import ConfigError, TrainingError
from vime.trainer.grpo import policy_loss

LABEL = "reference (FALLBACK: Qwen3Reference + torch AdamW, not Megatron)"


def pack(sequences: list[list[int]], prompt_lens: list[int]):
    """Varlen packing for teacher forcing: (input ids [T], cu_seqlens [B+1], rows predicting the
    response tokens [R], response targets [R], response positions per sequence)."""
    lens = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
    rows, positions = [], []
    for s, p, start in zip(sequences, prompt_lens, cu.tolist()):
        if not 1 <= p <= len(s):
            raise ValueError(f"prompt_len {p} must be in [1, len(sequence)={len(s)}]")
        rows.extend(range(start + p - 1, start + len(s) - 1))  # hidden at j-1 predicts token j
        positions.append(list(range(p, len(s))))
    rows = torch.tensor(rows, dtype=torch.int64)
    return ids, cu, rows, ids[rows + 1], positions


class ReferenceTrainer:
    label = LABEL

    def __init__(self, cfg: TrainerConfig, model_path: str, dtype: str, device: str, kl_coef: float):
        if cfg.tp != 1 or cfg.cp != 1:
            raise ConfigError(f"trainer.tp={cfg.tp}, trainer.cp={cfg.cp}: the reference fallback trainer runs "
                              "TP1/CP1 only; use trainer.engine=megatron for model parallelism")
        self.cfg = cfg
        self.model = Qwen3Reference.from_pretrained(model_path, dtype=getattr(torch, dtype), device=device)
        self.vocab_size = self.model.config.vocab_size
        self.ref = Qwen3Reference.from_pretrained(model_path, dtype=getattr(torch, dtype), device=device) \
            if kl_coef > 0 else None
        self.params = self._tensors(self.model)
        self.master = [torch.nn.Parameter(p.detach().to(torch.float32).clone()) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=cfg.lr, weight_decay=cfg.weight_decay)

    @staticmethod
    def _tensors(m: Qwen3Reference) -> list[torch.Tensor]:
        ts = [m.embed, m.norm] + ([] if m.lm_head is m.embed else [m.lm_head])
        return ts + [t for layer in m.layers for t in layer.values()]

    def _logprobs(self, model: Qwen3Reference, sequences, prompt_lens, temperature: float):
        ids, cu, rows, targets, positions = pack(sequences, prompt_lens)
        hidden = model.forward_packed(ids, cu)
        return model.logprobs(hidden[rows], targets, temperature), positions

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float):
        """Teacher-forcing fp32 logprobs of the response tokens, per sequence, and their positions."""
        with torch.no_grad():
            lp, positions = self._logprobs(self.model, sequences, prompt_lens, temperature)
        return list(lp.split([len(p) for p in positions])), positions

    def train_step(self, sequences, prompt_lens, temperature: float, old_logprobs: list[torch.Tensor],
                   advantages: list[float], clip_eps: float, kl_coef: float) -> dict[str, float]:
        n = len(sequences)
        mb = self.cfg.micro_batch_size or n
        total = sum(len(s) - p for s, p in zip(sequences, prompt_lens))
        for p in self.params:
            p.requires_grad_(True)
            p.grad = None
        stats: dict[str, float] = {"loss": 0.0}
        for a in range(0, n, mb):
            seqs, plens = sequences[a:a + mb], prompt_lens[a:a + mb]
            tokens = [len(s) - p for s, p in zip(seqs, plens)]
            lp, _ = self._logprobs(self.model, seqs, plens, temperature)
            old = torch.cat([t.to(torch.float32) for t in old_logprobs[a:a + mb]])
            adv = torch.cat([torch.full((k,), float(v)) for k, v in zip(tokens, advantages[a:a + mb])])
            ref = None
            if kl_coef > 0:
                with torch.no_grad():
                    ref, _ = self._logprobs(self.ref, seqs, plens, temperature)
            loss, s = policy_loss(lp, old, adv, torch.ones_like(lp), clip_eps, kl_coef, ref)
            loss = loss * (sum(tokens) / total)
            if not torch.isfinite(loss):
                raise TrainingError(f"non-finite loss {float(loss.detach())} in micro-batch {a // mb}: lower "
                                    "trainer.lr, check the rewards and advantages, or set trainer.grad_clip")
            loss.backward()
            stats["loss"] += float(loss.detach())
            for k, v in s.items():
                stats[k] = stats.get(k, 0.0) + v * sum(tokens) / total
        for master, p in zip(self.master, self.params):
            master.grad = p.grad.to(torch.float32) if p.grad is not None else torch.zeros_like(master)
            p.requires_grad_(False)
            p.grad = None
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.master, self.cfg.grad_clip or float("inf")))
        if not torch.isfinite(torch.tensor(stats["grad_norm"])):
            raise TrainingError(f"non-finite gradient norm {stats['grad_norm']}: lower trainer.lr")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, p in zip(self.master, self.params):
                p.copy_(master)
        return stats

    def save(self, path) -> None:
        """Model tensors, fp32 masters and AdamW state (torch.save; this fallback is TP1, one file)."""
        torch.save({"params": [p.detach().clone() for p in self.params], "master": [m.detach() for m in self.master],
                    "optimizer": self.optimizer.state_dict()}, f"{path}/reference_trainer.pt")

    def load(self, path) -> None:
        state = torch.load(f"{path}/reference_trainer.pt", weights_only=False)
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"]):
                p.copy_(saved)
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])

    def export_hf(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict_hf().items()}
