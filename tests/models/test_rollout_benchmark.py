"""benchmarks/vllm_throughput.py's rl_kernel mode (rl_kernel's own paged engine over the decode grid) end to end
on CPU with the tiny Qwen3: both passes timed, a TTFT per pass, and its parity sample re-scored by teacher forcing
with 0 fp32 bit mismatches (the GPU run compares it with native vLLM)."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_throughput import PARITY_SEQS, cuda_parity, parse_grid, rl_kernel_mode  # noqa: E402
from rl_kernel.models.tiny import make_tiny_qwen3  # noqa: E402


@pytest.mark.slow
def test_rl_kernel_mode_times_the_grid_and_matches_teacher_forcing(tmp_path):
    path = make_tiny_qwen3(tmp_path / "tiny")
    args = Namespace(grid=parse_grid("24x3,40x5"), new_tokens=3)
    result = rl_kernel_mode(path, args, device="cpu")
    assert [p["pass"] for p in result["passes"]] == [1, 2]
    for p in result["passes"]:
        assert [(r["context"], r["batch"]) for r in p["decode"]] == args.grid
        assert all(r["t_all_s"] > 0 and r["t_first_s"] > 0 for r in p["decode"])
        assert p["ttft_4k_s"] > 0
    assert len(result["samples"]) == 3 + PARITY_SEQS
    assert all(len(s["tokens"]) == 1 + args.new_tokens == len(s["logprobs"]) for s in result["samples"])
    cuda_parity(path, [result], device="cpu")
    assert [(r["context"], r["batch"]) for r in result["parity"]] == args.grid
    assert sum(r["tokens"] for r in result["parity"]) == (3 + PARITY_SEQS) * (1 + args.new_tokens)
    assert all(r["mismatches"] == 0 for r in result["parity"])
