"""`python -m vime.train +experiment=h200_vllm` on CUDA, small shapes: a killed vLLM engine is restarted and loaded
with the current weights over the configured transport (CUDA IPC into vLLM's `ipc` engine, not Ray's object
store, which vLLM on CUDA refuses), and a stopped run resumes from its checkpoint the same way; both with the
engine sleeping while the trainer works. Every step strict with 0 mismatches, and the steps after the kill and
after the resume equal the uninterrupted run's (timings and the restart count aside)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.vime.conftest import REPO, TRAIN_ENV, train_cmd
from tests.vime.test_resume import _actor_pids, _rows, _start, _untimed, _wait_rows

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

SMALL = (
    "+experiment=h200_vllm",
    "model.tiny.vocab_size=512",
    "model.tiny.hidden_size=512",
    "model.tiny.intermediate_size=1024",
    "model.tiny.num_layers=2",
    "model.tiny.num_heads=4",
    "model.tiny.num_kv_heads=2",
    "model.tiny.head_dim=128",
    "rollout.gpu_memory_utilization=0.15",
    "wandb.mode=disabled",
)


def _differ_only_in_restarts(rows: list[dict], base: list[dict]) -> bool:
    drop = ("engine_restarts",)
    return [{k: v for k, v in r.items() if k not in drop} for r in _untimed(rows)] == [
        {k: v for k, v in r.items() if k not in drop} for r in _untimed(base)
    ]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """4 steps; the engine's process is killed (SIGKILL) once step 0's metrics are written."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("vllm_killed") / "run"
    proc = _start(out, *SMALL, "steps=4")
    _wait_rows(proc, out / "metrics.jsonl", 1)
    engines = _actor_pids(proc.pid, "RolloutWorker")
    assert len(engines) == 1, engines
    os.kill(engines[0], signal.SIGKILL)
    text, _ = proc.communicate(timeout=240)
    return out, proc.returncode, text


def test_killed_engine_is_restarted_and_reloaded_over_ipc(killed_run):
    out, code, text = killed_run
    assert code == 0, text[-5000:]
    assert "rollout engine 0 died; restarting it on weight version 1" in text, text[-5000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["engine_restarts"] for r in rows] == [0, 1, 1, 1]
    assert all(r["mismatch_count"] == 0 and r["tokens"] > 0 for r in rows)
    assert all(r["sync_bytes"] > 0 for r in rows)  # every sync a real IPC push


def test_stopped_run_resumes_over_ipc_with_the_same_steps(killed_run, tmp_path):
    base, _, _ = killed_run
    out = tmp_path / "stopped"
    first = subprocess.run(
        train_cmd(*SMALL, "steps=4", "checkpoint.every=1", "checkpoint.stop_after=1", f"output_dir={out}"),
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert [r["step"] for r in _rows(out)] == [0, 1]
    resumed = subprocess.run(
        train_cmd(f"resume={out}"),  # a resumed run takes its config from its checkpoint
        cwd=REPO,
        env=os.environ | TRAIN_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["mismatch_count"] == 0 for r in rows)
    assert _differ_only_in_restarts(rows, _rows(base))
