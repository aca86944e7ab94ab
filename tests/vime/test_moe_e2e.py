"""End to end with the tiny Qwen3-MoE (`+experiment=tiny_moe`: 8 experts, top-2): `python -m vime.train` with the
real components (Ray, the strict vLLM Qwen3-MoE model, the Megatron MoE layer spec, the weight push of every
expert weight). Strict: on every step 0 logprob mismatches and 0 routing disagreements over every (token, MoE
layer) route both sides recorded. Native twin (extended tier): vLLM's and Megatron's own kernels disagree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.megatron]


def _run(out: Path, *overrides: str) -> list[dict]:
    env = os.environ | {"WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "vime.train", "+experiment=tiny_moe", "steps=2", "data.task=arithmetic"]
    cmd += [f"output_dir={out}", "checkpoint.final=false", "checkpoint.export_hf=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["tokens"] > 0 for r in rows)
    return rows


def test_strict_moe_run_has_zero_mismatches_and_routing_disagreements(tmp_path):
    rows = _run(tmp_path / "strict")
    for r in rows:
        assert r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0, r
        assert r["routes_compared"] > 2 * r["tokens"], r  # prompt and response positions x 2 MoE layers
        assert r["routing_mismatch"] == 0.0 and r["routing_mismatch_count"] == 0, r
        assert r["rollout_engine"].startswith("vllm ") and "strict plugin" in r["rollout_engine"]
        assert {"moe_router", "moe_experts", "moe_combine"} <= set(r["contracts"]), r["contracts"]
        assert {r["contracts"][op] for op in ("moe_router", "moe_experts", "moe_combine")} == {"same"}


@pytest.mark.extended
def test_native_moe_run_twin_disagrees(tmp_path):
    rows = _run(tmp_path / "native", "rollout.mode=native", "trainer.mode=native", "fail_on_mismatch=false")
    for r in rows:
        assert r["mismatch_count"] > 0, r
        assert r["routes_compared"] > 0 and r["routing_mismatch"] is not None, r
    # before any weight push (21 of 1754 routes on this seed; later steps disagree far more, see docs/moe.md)
    assert rows[0]["routing_mismatch_count"] > 0, rows[0]
