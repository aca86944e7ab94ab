"""The trainer's side of exact top-k / top-p and the entropy term (the reference trainer, in-process, strict).

Scoring and the training forward rebuild the same truncated support (equal bits, ratio exactly 1.0), the step
logs the full-vocab entropy and `algo.entropy_coef` adds its gradient; a sampled token outside the trainer's
support is refused (TrainingError), never dropped."""

from __future__ import annotations

import pytest
import torch

import rl_kernel as rk
from rl_kernel.bits import bit_mismatches
from rl_kernel.ops.truncation import Truncation
from vime.config.schema import TrainerConfig
from vime.errors import TrainingError
from vime.trainer.grpo import LossConfig, TrainBatch
from vime.trainer.reference import ReferenceTrainer

PROMPTS = [[10, 11, 12], [7, 8], [20, 21, 22, 23]]
TRUNCATION = Truncation(top_k=20, top_p=0.9)


def _trainer(path, truncation=TRUNCATION, entropy_coef=0.0) -> ReferenceTrainer:
    loss = LossConfig(entropy_coef=entropy_coef)
    return ReferenceTrainer(TrainerConfig(lr=1e-3), str(path), "bfloat16", "cpu", loss, truncation=truncation)


def _greedy(trainer: ReferenceTrainer, steps: int = 4) -> list[list[int]]:
    """Prompts extended by their most likely tokens (always inside any support)."""
    seqs = [list(p) for p in PROMPTS]
    model = trainer.model
    for _ in range(steps):
        for s in seqs:
            with torch.no_grad():
                hidden = model.forward_packed(torch.tensor(s), torch.tensor([0, len(s)]))
                logits = model.logits_fp32(hidden[-1:])[0, : model.config.vocab_size]
            s.append(int(logits.argmax()))
    return seqs


def test_scoring_and_training_rebuild_one_support(tiny_qwen3_path):
    with rk.mode("strict"):
        trainer = _trainer(tiny_qwen3_path)
        seqs, plens = _greedy(trainer), [len(p) for p in PROMPTS]
        scored, _ = trainer.score(seqs, plens, 1.0)
        full = trainer.model.sequence_logprobs(seqs, plens, 1.0)
        trainer.micro_batch_size = 1  # another packing than the scoring pass
        stats = trainer.train_step(TrainBatch(seqs, plens, [1.0, -0.5, 0.25], scored, keep_logprobs=True))
    assert bit_mismatches(scored, stats["logprobs"]) == 0
    assert stats["mismatch_count"] == 0 and stats["ratio_mean"] == 1.0
    assert all(bool((s > f).all()) for s, f in zip(scored, full))  # renormalised over the support
    assert stats["entropy"] > 0


def test_entropy_is_logged_and_entropy_coef_adds_its_gradient(tiny_qwen3_path):
    seqs = [p + [30, 31, 32] for p in PROMPTS]
    plens = [len(p) for p in PROMPTS]
    runs = {}
    for coef in (0.0, 0.5):
        trainer = _trainer(tiny_qwen3_path, truncation=None, entropy_coef=coef)
        old, _ = trainer.score(seqs, plens, 1.0)
        runs[coef] = trainer.train_step(TrainBatch(seqs, plens, [1.0, -0.5, 0.25], old))
    assert runs[0.0]["entropy"] == runs[0.5]["entropy"] > 0  # the same weights, the same forward
    assert runs[0.5]["loss"] == pytest.approx(runs[0.0]["loss"] - 0.5 * runs[0.0]["entropy"], rel=1e-5, abs=1e-6)
    assert runs[0.5]["grad_norm"] != runs[0.0]["grad_norm"]


def test_a_token_outside_the_trainer_support_is_refused(tiny_qwen3_path):
    trainer = _trainer(tiny_qwen3_path, truncation=Truncation(top_k=1))
    seqs = _greedy(trainer, steps=2)
    plens = [len(p) for p in PROMPTS]
    old, _ = trainer.score(seqs, plens, 1.0)
    assert all(bool(torch.isfinite(o).all()) for o in old)
    seqs[0][-1] = (seqs[0][-1] + 1) % trainer.vocab_size  # not the most likely token: outside top-1
    with pytest.raises(TrainingError, match="1 sampled token"):
        trainer.train_step(TrainBatch(seqs, plens, [1.0, -0.5, 0.25], old))
