"""Smoke test of benchmarks/rl_layout.py (issue 6's script) on CPU: torchrun, 2 gloo ranks, TP2 x CP1,
tiny preset. Megatron-core trainer vs the reference paged rollout at TP2, weight push between steps:
strict agrees bit for bit on every response token of every step, the native twin does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

ROOT = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, GROUP, NEW_TOKENS = 2, 2, 2, 12


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("rl_layout")
    out = tmp / "rl_layout.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "rl_layout.py"), "--tp", "2", "--cp", "1", "--device", "cpu", "--preset", "tiny",
           "--steps", str(STEPS), "--prompts", str(PROMPTS), "--group", str(GROUP), "--new-tokens", str(NEW_TOKENS),
           "--out", str(out), "--ckpt-dir", str(tmp)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_KERNEL_")} | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"rl_layout.py exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "RESULT rl_layout tp2 cp1: strict 0 mismatches" in proc.stdout
    return json.loads(out.read_text())


def test_strict_rollout_and_megatron_agree_bitwise_every_step(layout_run):
    r = layout_run
    assert r["complete"] and (r["world_size"], r["tp"], r["cp"]) == (2, 2, 1)
    steps = r["modes"]["strict"]["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s["tokens"] == PROMPTS * GROUP * NEW_TOKENS  # every response token is compared
        assert (s["mismatch_count"], s["max_abs_diff"], s["train_mismatch_count"]) == (0, 0.0, 0)
        assert s["ratio_mean"] == 1.0
        assert s["weights_changed"] > 0  # the update is real, so agreement after the push proves the sync
    assert r["summary"]["strict_ok"] and r["summary"]["strict_contracts_match"]
    assert {op.split(":")[0] for op in r["modes"]["strict"]["rollout_ops"]} >= {
        "gemm", "rms_norm", "rope", "attention", "silu_and_mul", "logprobs"}


def test_native_twin_mismatches_every_step(layout_run):
    steps = layout_run["modes"]["native"]["steps"]
    assert len(steps) == STEPS
    for s in steps:
        assert s["tokens"] == PROMPTS * GROUP * NEW_TOKENS
        assert s["mismatch_count"] > s["tokens"] // 2 and s["max_abs_diff"] > 0
        assert s["weights_changed"] > 0
    assert layout_run["summary"]["native_mismatch_every_step"]
    assert any(":native:" in op for op in layout_run["modes"]["native"]["trainer_ops"])
