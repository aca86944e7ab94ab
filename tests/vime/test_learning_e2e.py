"""End to end, the main job as a new user runs it: `python -m vime.train` with no overrides but the
output dir (real Ray, vLLM with the rl_kernel plugin, Megatron-core, W&B offline): the shared `default_run`.

The default run must visibly learn (the reward rises: a trend, not a value), keep rollout == trainer
bit for bit on every step, keep the console quiet (engine and framework output in engines.log), end
with a summary, and write one figure. Then `vime.audit audit.run=<that run>` reads its per-step
evidence without starting an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron]


def test_default_run_learns_with_zero_mismatches(default_run):
    assert default_run.proc.returncode == 0, default_run.console[-6000:]
    rows = default_run.rows()
    assert len(rows) >= 20 and [r["step"] for r in rows] == list(range(len(rows)))
    for r in rows:
        assert r["strict"] is True and r["tokens"] > 0
        assert r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["train_mismatch_count"] == 0, r
    rewards = [r["reward_mean"] for r in rows]
    q = len(rewards) // 4
    early, late = sum(rewards[:q]) / q, sum(rewards[-q:]) / q
    print(f"reward: first quarter {early:.3f}, last quarter {late:.3f}; per step {[round(x, 2) for x in rewards]}")
    assert late > early + 0.2, f"the default run did not learn: first quarter {early:.3f}, last quarter {late:.3f}"
    halves = len(rewards) // 2
    assert sum(rewards[halves:]) / (len(rewards) - halves) > sum(rewards[:halves]) / halves
    assert all(r["samples"] and len(r["samples"][0]) == 3 for r in rows)  # sample completions every step


def test_default_run_console_is_quiet_and_ends_with_a_summary(default_run):
    out, rows, console = default_run.out, default_run.rows(), default_run.console
    lines = [line for line in console.splitlines() if line.strip()]
    noise = [line for line in lines if "Transformer Engine" in line or "INFO 1" in line or "prefix cache" in line]
    assert not noise, noise[:5]
    assert len(lines) < len(rows) + 40, "\n".join(lines)
    text = "\n".join(lines)
    assert "run summary (strict)" in text and "tokens compared" in text and "0 in total" in text
    assert "reward" in text and str(out) in text
    engines_log = (out / "engines.log").read_text()
    assert "vLLM" in engines_log or "vllm" in engines_log  # the engines' output is kept, in the log file
    assert (out / "consistency.png").stat().st_size > 10_000
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))


def test_audit_reads_an_earlier_runs_evidence(default_run, tmp_path):
    out, rows = default_run.out, default_run.rows()
    env = os.environ | {"WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "vime.audit", f"audit.run={out}", f"output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["total_mismatches"] == 0 and len(report["steps"]) == len(rows)
    assert f"{len(rows)} steps, 0 mismatching tokens" in proc.stdout
