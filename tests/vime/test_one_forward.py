"""One forward fewer per step: the training forward's logprobs are the step's consistency measurement.

`grpo.train_step` with `keep_logprobs` returns the logprobs of the forward the optimizer step runs
anyway; strict, they equal the separate no-grad scoring pass's in raw bits, although training packs
the sequences in micro-batches of one and scoring packs them all together (the driver relies on
this when `trainer.scoring_pass` is false).
"""

from __future__ import annotations

import torch

import rl_kernel as rk
from rl_kernel.bits import bit_mismatches
from vime.config.schema import TrainerConfig
from vime.trainer.grpo import LossConfig, TrainBatch
from vime.trainer.reference import ReferenceTrainer

SEQS = [[10, 11, 12, 13, 14, 15], [10, 11, 12, 20], [7, 8, 9, 30, 31, 32, 33, 34]]
PLENS = [3, 3, 2]


def _both(path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(scoring-pass logprobs, training-forward logprobs) of SEQS under the same weights."""
    trainer = ReferenceTrainer(TrainerConfig(lr=1e-3, micro_batch_size=1), str(path), "bfloat16", "cpu", LossConfig())
    trainer.micro_batch_size = None  # the scoring pass packs all sequences together
    scored, _ = trainer.score(SEQS, PLENS, 1.0)
    trainer.micro_batch_size = 1  # the training step packs one sequence per micro-batch
    stats = trainer.train_step(
        TrainBatch(SEQS, PLENS, [1.0, -0.5, 0.25], [s.clone() for s in scored], keep_logprobs=True)
    )
    return scored, stats["logprobs"]


def test_the_training_forward_scores_in_the_scoring_pass_bits(tiny_qwen3_path):
    with rk.mode("strict"):
        scored, trained = _both(tiny_qwen3_path)
    assert [t.shape for t in trained] == [torch.Size([len(s) - p]) for s, p in zip(SEQS, PLENS)]
    assert bit_mismatches(scored, trained) == 0
