"""benchmarks/rl_step.py: the RL-step summary read from scripts/gpu_train.sh's JSON (pure logic)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.rl_step import PHASES, summarize  # noqa: E402


def _run(status: str, step_s: float, mismatches: int) -> dict:
    medians = {k: 1.0 for k in PHASES} | {"step_s": step_s}
    return {
        "status": status,
        "steps": [{"tokens": 65536}] * 5,
        "mismatch_total": mismatches,
        "tokens_total": 5 * 65536,
        "median_after_step0": medians,
    }


def test_summary_names_sizes_medians_and_the_ratio():
    runs = {
        "preset": "h200_vllm",
        "overrides": "model.tiny.num_layers=16 algo.prompts_per_step=8 algo.group_size=8 algo.max_new_tokens=1024",
        "runs": {"strict_1gpu": _run("PASS", 10.5, 0), "native_1gpu": _run("PASS", 10.0, 327680)},
        "gpus": ["NVIDIA H200"],
    }
    s = summarize(runs)
    assert (s["layers"], s["sequences"], s["new_tokens"], s["tokens_per_step"]) == (16, 64, 1024, 65536)
    assert s["mismatches"] == 0 and s["native_mismatches"] == 327680
    assert (s["strict_step_s"], s["native_step_s"], s["strict_over_native_step"]) == (10.5, 10.0, 1.05)
    assert set(s["phases"]["strict"]) == set(PHASES)


def test_summary_of_a_missing_run_says_so():
    s = summarize({"overrides": "", "runs": {"strict_1gpu": _run("TIMEOUT", 3.0, 0)}})
    assert s["native_status"] == "NOT RUN" and s["native_step_s"] is None and "strict_over_native_step" not in s
    assert s["layers"] is None and s["sequences"] is None
