"""Nothing is lost (issue 13), end to end with the real components (Ray, vLLM, Megatron, Hydra, W&B).

One run is stopped with SIGTERM after its first checkpoint, then resumed with `resume=<dir>`. The
stop is clean (exit 143, no traceback, the resume command printed); starting a new run in that dir
is refused without touching it; the resumed run ends with the same metrics and the same final
weights, in raw bits, as the uninterrupted twin (`strict_run`, shared with test_train_e2e.py).
Where the signal lands within step 1 does not matter: whatever came after the checkpoint is redone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rl_kernel.bits import same_bits
from tests.vime.conftest import REPO, TRAIN_ENV, train_cmd
from vime.checkpoint import TIMING_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "hf_model" / "model.safetensors"))


def _stop_after_first_checkpoint(out: Path) -> tuple[int, str]:
    """Start a 2-step run saving every step; SIGTERM it once step 0's checkpoint is complete."""
    proc = subprocess.Popen(train_cmd("steps=2", "checkpoint.every=1", f"output_dir={out}"), cwd=REPO,
                            env=os.environ | TRAIN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 420
    while not (out / "checkpoints" / "latest").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=180)
    return proc.returncode, text


def test_stopped_then_resumed_run_is_identical_in_bits(strict_run, tmp_path):
    base, base_proc = strict_run
    assert base_proc.returncode == 0, base_proc.stderr[-4000:]
    out = tmp_path / "stopped"

    code, text = _stop_after_first_checkpoint(out)
    assert code == 143, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert "continue from step_00000" in text and f"python -m vime.train resume={out}" in text
    assert (out / "consistency.png").is_file()  # the plot of the steps so far

    log_size = (out / "train.log").stat().st_size
    again = subprocess.run(train_cmd("steps=2", f"output_dir={out}"), cwd=REPO, env=os.environ | TRAIN_ENV,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and f"continue that run with `python -m vime.train resume={out}`" in again.stderr
    assert (out / "train.log").stat().st_size == log_size  # refused before Hydra wrote anything

    resumed = subprocess.run(train_cmd(f"resume={out}"), cwd=REPO, env=os.environ | TRAIN_ENV,
                             capture_output=True, text=True, timeout=420)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "resumed from" in resumed.stderr + resumed.stdout

    rows, base_rows = _rows(out), _rows(base)
    assert [r["step"] for r in rows] == [0, 1]  # nothing lost, nothing repeated
    assert _untimed(rows) == _untimed(base_rows)
    weights, base_weights = _weights(out), _weights(base)
    assert weights.keys() == base_weights.keys()
    for name, t in weights.items():
        assert t.dtype == base_weights[name].dtype
        assert same_bits(t, base_weights[name]), name


def _actor_pids(pid: int, actor: str) -> list[int]:
    """Processes of the run's `actor` class (RolloutWorker, TrainerWorker): descendants of the driver
    (its Ray) whose title names the class, less the helpers they fork (a trainer rank's checkpoint
    writers carry its title too)."""
    import psutil

    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if actor in " ".join(p.cmdline()) and actor not in " ".join(p.parent().cmdline()):
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_rows(proc: subprocess.Popen, metrics: Path, n: int) -> None:
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline and \
            not (metrics.is_file() and metrics.read_text().count("\n") >= n):
        time.sleep(0.2)


def test_a_killed_rollout_engine_is_restarted_and_a_killed_trainer_ends_the_run_cleanly(strict_run, tmp_path):
    """kill -9 of the vLLM engine's process after step 0: the engine is restarted on weight version 1 and
    step 1 comes out as if nothing happened (its metrics equal the uninterrupted run's, in bits), the
    restart logged and counted. Then kill -9 of the trainer rank during step 2: the run ends (exit 1)
    with one line naming the rank and the command that resumes from the last checkpoint."""
    base, _ = strict_run
    out = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd("steps=3", "checkpoint.every=1", f"output_dir={out}"), cwd=REPO,
                            env=os.environ | TRAIN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_rows(proc, out / "metrics.jsonl", 1)
    engines = _actor_pids(proc.pid, "RolloutWorker")
    assert len(engines) == 1, engines
    os.kill(engines[0], signal.SIGKILL)  # during step 0's checkpoint save, before step 1's rollout
    _wait_rows(proc, out / "metrics.jsonl", 2)
    trainers = _actor_pids(proc.pid, "TrainerWorker")
    assert len(trainers) == 1, trainers
    os.kill(trainers[0], signal.SIGKILL)
    text, _ = proc.communicate(timeout=420)
    assert proc.returncode == 1, text[-6000:]
    assert "rollout engine 0 died; restarting it on weight version 1 (restart 1 of at most 3)" in text
    assert "EngineDiedError: trainer rank 0 died during" in text and "Traceback" not in text, text[-6000:]
    assert f"with: python -m vime.train resume={out}" in text
    rows, base_rows = _rows(out), _rows(base)
    assert [r["engine_restarts"] for r in rows] == [0, 1]
    assert _untimed(rows) == [r | {"engine_restarts": n} for r, n in zip(_untimed(base_rows), (0, 1))]
