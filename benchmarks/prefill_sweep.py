"""Launch configurations of the strict Triton prefill attention against SDPA's default (cuDNN), in rounds.

    python3 benchmarks/prefill_sweep.py [--rounds 3] [--json out.json]

One causal sequence of T tokens, Qwen3-8B heads (32 query / 8 KV, d = 128), bf16. Each round times every
configuration and SDPA once, interleaved, so drift in clocks or power lands on all of them; the table gives each
configuration's median over the rounds and its spread. Every configuration's output must equal the default's
bit for bit (no bit depends on the launch configuration).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from rl_kernel.backends.triton import attention

CONFIGS = {  # name: (BLOCK_M, num_warps, num_stages, FLAT, HEAVY_FIRST, TMA)
    "64/w4/s3/flat/heavy-first/tma": (64, 4, 3, True, True, True),
    "64/w4/s3/flat/tma": (64, 4, 3, True, False, True),
    "64/w4/s3/flat/heavy-first": (64, 4, 3, True, True, False),
    "128/w8/s4/flat/heavy-first/tma": (128, 8, 4, True, True, True),
    "128/w8/s4/flat/tma": (128, 8, 4, True, False, True),
    "64/w4/s2/flat/tma": (64, 4, 2, True, False, True),
}


def sweep_length(t: int, rounds: int, h: int = 32, hkv: int = 8, d: int = 128) -> dict:
    q, k, v = (torch.randn(t, n, d, device="cuda").to(torch.bfloat16) for n in (h, hkv, hkv))
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    qt, kt, vt = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
    ref = attention.varlen_attention(q, k, v, cu, d**-0.5)
    fns = {
        "sdpa (cuDNN)": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=d**-0.5, enable_gqa=True
        )
    }
    bits = {}
    for name, (bm, warps, stages, flat, heavy, tma) in CONFIGS.items():
        cfg = {"BLOCK_M": bm, "num_warps": warps, "num_stages": stages, "FLAT": flat, "HEAVY_FIRST": heavy, "TMA": tma}
        out = attention.varlen_attention(q, k, v, cu, d**-0.5, config=cfg)
        bits[name] = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        fns[name] = lambda cfg=cfg: attention.varlen_attention(q, k, v, cu, d**-0.5, config=cfg)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=10, rep=100, return_mode="median"))
    native = statistics.median(times["sdpa (cuDNN)"])
    flops = 2 * t * t * h * d
    print(f"T={t}: sdpa {native:.4f} ms")
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {
            "ms_median": round(med, 4),
            "ms_min": round(min(ts), 4),
            "ms_max": round(max(ts), 4),
            "sdpa_over_this": round(native / med, 3),
            "tflops": round(flops / med * 1e-9, 1),
        }
        if name in bits:
            rows[name]["bits_equal_default"] = bits[name]
        print(
            f"  {name:32s} {med:8.4f} ms  [{min(ts):.4f} .. {max(ts):.4f}]  sdpa/this {native / med:.3f}"
            + ("" if bits.get(name, True) else "  BITS DIFFER"),
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--json")
    args = p.parse_args()
    results = {t: sweep_length(t, args.rounds) for t in (int(x) for x in args.lengths.split(","))}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "default": attention.PREFILL, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
