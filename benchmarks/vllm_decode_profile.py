"""Where strict vLLM's decode time goes, against native vLLM: torch profiler over one decode-heavy `generate`.

    python benchmarks/vllm_decode_profile.py [--layers 8] [--batch 128] [--context 512] [--new-tokens 32] [--eager]

Per mode (strict, then native), one in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the profiler sees the
worker) over a random Qwen3 with Qwen3-8B layer shapes, CUDA graphs on both (`--eager`: none). After a warm-up
`generate` of the same shapes, the profiled one decodes `--new-tokens` tokens for `--batch` cached prompts of
`--context` tokens. Prints, per mode, the GPU kernels by total time (the kernels inside captured CUDA graphs
included) and the totals per decode step; writes benchmarks/results/vllm_decode_profile_h200.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm_throughput import QWEN3_8B, grid_prompts  # noqa: E402
from rl_kernel.integrations.vllm import (  # noqa: E402
    native_llm_kwargs,
    native_sampling_params,
    strict_llm_kwargs,
    strict_sampling_params,
)
from rl_kernel.models.tiny import make_tiny_qwen3  # noqa: E402


def kernel_table(prof, top: int) -> tuple[list[dict], float, int]:
    """(top kernels by total device time, total device ms, kernel launches) of the profiled region."""
    rows, total_us, launches = [], 0.0, 0
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if device_us <= 0 or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total_us += device_us
        launches += e.count
        rows.append({"kernel": e.key[:90], "calls": e.count, "total_ms": round(device_us / 1e3, 3),
                     "avg_us": round(device_us / max(e.count, 1), 2)})
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top], total_us / 1e3, launches


def profile_mode(mode: str, path: Path, args) -> dict:
    from vllm import LLM

    engine = dict(dtype="bfloat16", seed=0, max_model_len=args.context + args.new_tokens + 16, max_num_seqs=256,
                  max_num_batched_tokens=8192, enable_prefix_caching=True, gpu_memory_utilization=0.6,
                  enforce_eager=args.eager)
    make_kwargs, make_params = ((strict_llm_kwargs, strict_sampling_params) if mode == "strict"
                                else (native_llm_kwargs, native_sampling_params))
    llm = LLM(**make_kwargs(path, device="cuda", **engine))
    prompts = [{"prompt_token_ids": p} for p in grid_prompts(args.context, args.batch, 0)]
    try:
        def params(n: int) -> list:
            return [make_params(temperature=1.0, max_tokens=n, seed=i, ignore_eos=True) for i in range(args.batch)]

        llm.generate(prompts, params(1 + args.new_tokens), use_tqdm=False)  # warm-up; the prompts are cached after
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params(1), use_tqdm=False)
        torch.cuda.synchronize()
        t_first = time.perf_counter() - t0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params(1 + args.new_tokens), use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    top, device_ms, launches = kernel_table(prof, args.top)
    steps = args.new_tokens + 1
    return {"mode": mode, "wall_s": round(wall, 4), "first_token_s": round(t_first, 4),
            "decode_ms_per_step": round((wall - t_first) * 1e3 / args.new_tokens, 3),
            "gpu_kernel_ms": round(device_ms, 2), "gpu_kernel_ms_per_step": round(device_ms / steps, 3),
            "kernels_per_step": round(launches / steps, 1), "top": top}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--modes", default="strict,native")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_qwen3(Path(tmp) / "qwen3_8b_shapes", num_layers=args.layers, device="cuda", init_std=0.02,
                               **QWEN3_8B)
        results = [profile_mode(m, path, args) for m in args.modes.split(",")]
    graphs = "eager" if args.eager else "CUDA graphs"
    for r in results:
        print(f"\n== {r['mode']} ({graphs}, {args.layers} layers, batch {args.batch}, context {args.context}): "
              f"decode {r['decode_ms_per_step']} ms/step wall, GPU kernels {r['gpu_kernel_ms_per_step']} ms/step, "
              f"{r['kernels_per_step']} kernels/step")
        print(f"{'total ms':>9} {'calls':>6} {'avg us':>8}  kernel")
        for k in r["top"]:
            print(f"{k['total_ms']:>9.2f} {k['calls']:>6} {k['avg_us']:>8.1f}  {k['kernel']}")
    out = args.out or Path(__file__).resolve().parent / "results" / "vllm_decode_profile_h200.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "layers": args.layers, "batch": args.batch,
                               "context": args.context, "new_tokens": args.new_tokens, "graphs": not args.eager,
                               "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
