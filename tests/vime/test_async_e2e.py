"""End to end: asynchronous GRPO (`algo.max_staleness=1`) with the real components (Ray, vLLM with the
rl_kernel plugin, Megatron-core, Hydra, W&B offline).

- Lag 1, whole-sample versions: step 0 (every token fresh) equals the synchronous run's step 0 in every
  metric (timings aside); from step 1 on every token is one version behind, the trainer reproduces all
  of them in bits under the kept version (0 mismatches), the importance ratio is exactly 1.0 on every
  fresh token and moves once the weights moved.
- In-flight updates (`rollout.partial=true`, `rollout.partial_wait=1`): each rollout after the first
  takes the next version after its first token, so samples carry mixed versions; the trainer reproduces
  them in bits (prefix K/V under v, later tokens under v+1). The native twin mismatches (made by the same
  invocation: `compare=native` runs it first, under `<out>/native`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.checkpoint import TIMING_KEYS

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron]
ASYNC = ("algo.max_staleness=1", "algo.correction=tis")
# keys an asynchronous row adds (or measures differently: the re-scoring pass has its own time)
ASYNC_KEYS = {"stale_groups", "requeued_groups", "mixed_samples", "stale_samples", "behaviour_checked_tokens",
              "behaviour_check_rate", "rollout_staleness_max", "lag_share_1", *TIMING_KEYS}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(out: Path, *overrides: str, timeout: int = 600) -> list[dict]:
    """The default run (as `strict_run`: 2 steps) with `overrides`."""
    env = os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "vime.train", "steps=2", f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1] and all(r["tokens"] > 0 for r in rows)
    return rows


def test_lag1_is_exact_and_lag0_equals_the_synchronous_run(tmp_path, strict_run):
    """The synchronous twin is the shared default strict run (`strict_run`, 2 steps, the same seed)."""
    rows = _train(tmp_path / "async", *ASYNC)
    assert strict_run.proc.returncode == 0, strict_run.proc.stderr[-3000:]
    sync = _rows(strict_run.out)[0]
    first = rows[0]
    assert first["lag_share_0"] == 1.0 and first["staleness_max"] == 0
    differ = {k for k in sync if k not in ASYNC_KEYS and sync[k] != first.get(k)}
    assert not differ, {k: (sync[k], first.get(k)) for k in differ}
    for r in rows:
        assert r["strict"] is True and r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["lag0_ratio_off"] == 0 and r["stale_groups"] == 0
        assert r["behaviour_check_rate"] == 1.0
    for r in rows[1:]:
        assert r["lag_share_1"] == 1.0 and r["staleness_max"] == 1 and r["staleness_mean"] == 1.0
        assert r["stale_samples"] > 0 and r["behaviour_checked_tokens"] == r["tokens"]  # every token re-scored
        assert r["lag0_tokens"] == 0 and r["is_ratio_max"] != 1.0  # the weights moved: w is staleness
    assert rows[0]["grad_norm"] > 0


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """(rows, native twin's rows) of the in-flight update run: one invocation, `compare=native`."""
    out = tmp_path_factory.mktemp("partial") / "run"
    rows = _train(out, *ASYNC, "rollout.partial=true", "rollout.partial_wait=1", "compare=native",
                  "checkpoint.final=false", "checkpoint.export_hf=false", timeout=1200)  # no test reads its checkpoints
    native = _rows(out / "native")
    assert [r["step"] for r in native] == [0, 1] and all(r["tokens"] > 0 for r in native)
    return rows, native


def test_in_flight_updates_give_mixed_versions_reproduced_in_bits(partial_run):
    rows = partial_run[0]
    for r in rows:
        assert r["strict"] is True and r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["lag0_ratio_off"] == 0
    for r in rows[1:]:
        # with 2 new tokens, the requests prefilled last take version 1 for their second token
        assert r["mixed_samples"] > 0, r  # the update landed inside running requests
        assert r["lag_share_0"] > 0 and r["lag_share_1"] > 0 and r["staleness_max"] == 1
        assert r["behaviour_checked_tokens"] > 0 and r["behaviour_check_rate"] == 1.0


def test_native_twin_of_the_async_run_mismatches(partial_run):
    rows = partial_run[1]
    for r in rows:
        assert r["strict"] is False and r["mismatch_count"] > 0, r
    assert any(r["mixed_samples"] > 0 for r in rows[1:])
    assert rows[0]["lag0_ratio_off"] > 0  # native: w of fresh tokens is not exactly 1.0
