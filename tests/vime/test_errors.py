"""Bad input and failures give clear errors that say what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

from vime.config.schema import TrainerConfig, VimeConfig
from vime.errors import EngineDiedError, TrainingError, VimeError, WeightSyncError
from vime.loop.driver import call, make_model
from vime.trainer.grpo import LossConfig, TrainBatch
from vime.trainer.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parents[2]


def _cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vime.train", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"WANDB_MODE": "offline"},
    )


@pytest.mark.slow
def test_cli_rejects_a_malformed_override(tmp_path):
    proc = _cli("rollout.mode=bogus", f"output_dir={tmp_path}")
    assert proc.returncode != 0
    assert "Invalid value 'bogus', expected one of [strict, native]" in proc.stderr


@pytest.mark.slow
def test_cli_reports_a_missing_checkpoint(tmp_path):
    proc = _cli(f"model.path={tmp_path / 'nope'}", f"output_dir={tmp_path}")
    assert proc.returncode != 0
    assert "is not an HF checkpoint directory (no config.json)" in proc.stdout + proc.stderr


def test_missing_checkpoint_error(tmp_path):
    cfg = VimeConfig()
    cfg.model.path = str(tmp_path)
    with pytest.raises(VimeError, match="no config.json.*leave model.path unset"):
        make_model(cfg, tmp_path)


@ray.remote(num_cpus=0)
class _Flaky:
    def die(self) -> None:
        os._exit(1)

    def bad_value(self) -> None:
        raise ValueError("prompt ids out of range")

    def refuse(self) -> None:
        raise WeightSyncError("weight version 3 is not above the served version 3")

    def relay(self, other) -> None:  # a trainer rank waiting on an engine's reply, as weight pushes do
        ray.get(other.refuse.remote())


@pytest.mark.slow
def test_a_dead_or_failing_actor_is_named():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        a, b = _Flaky.remote(), _Flaky.remote()
        with pytest.raises(EngineDiedError, match="rollout engine 1 died during 'generate'"):
            call([b.die.remote()], "generate", ["rollout engine 1"])
        with pytest.raises(ValueError, match=r"rollout engine 0 \(generate\): prompt ids out of range"):
            call([a.bad_value.remote()], "generate", ["rollout engine 0"])
        with pytest.raises(WeightSyncError) as raised:  # an engine's refusal through another actor: still one line
            call([a.relay.remote(_Flaky.remote())], "sync", ["trainer rank 0"])
        assert type(raised.value) is WeightSyncError
        assert str(raised.value) == "trainer rank 0 (sync): weight version 3 is not above the served version 3"
    finally:
        ray.shutdown()


def test_non_finite_loss_is_a_training_error(tiny_qwen3_path):
    trainer = ReferenceTrainer(TrainerConfig(lr=1e-3), str(tiny_qwen3_path), "bfloat16", "cpu", LossConfig())
    seqs, plens = [[10, 11, 12, 13, 14], [10, 11, 12, 20]], [3, 3]
    old, _ = trainer.score(seqs, plens, 1.0)
    with pytest.raises(TrainingError, match="non-finite loss"):
        trainer.train_step(TrainBatch(seqs, plens, [float("nan"), 1.0], old))
    stats = trainer.train_step(TrainBatch(seqs, plens, [1.0, -1.0], old))
    assert stats["grad_norm"] > 0 and stats["ratio_mean"] == 1.0  # old == current logprobs: ratio exactly 1
    new, _ = trainer.score(seqs, plens, 1.0)
    assert not torch.equal(torch.cat(new), torch.cat(old))  # the step moved the weights
