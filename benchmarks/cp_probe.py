"""Where the strict CP2 attention forward (Triton contract) spends its time, on one GPU.

    python3 benchmarks/cp_probe.py [out.json]        # benchmarks/results/cp_probe_h200.json

The two CP ranks of `tests/gpu/gpu_path.py`'s case (8 packed sequences, 9547 tokens, Qwen3-8B heads) run in one
process: each rank's split partials (`triton_rank_partials`), the all-to-all emulated by a permutation, and each
rank's fold (`triton_fold`). Each phase is timed alone (CUDA-synchronised medians), beside the CP1 forward, and
the folded outputs are checked against CP1 bit for bit. The collectives are not timed here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rl_kernel as rk  # noqa: E402
from rl_kernel.bits import bit_mismatches  # noqa: E402
from rl_kernel.integrations.megatron import cp as cpm  # noqa: E402
from tests.gpu.gpu_path import timed  # noqa: E402  (the CP rows of gpu_path.py are timed the same way)

DEV, BF16 = "cuda", torch.bfloat16


def ms(fn) -> float:
    """`timed`'s median (CUDA-synchronised wall time) over 7 calls, in ms to 3 places; callers warm `fn` first."""
    return round(timed(fn, reps=7), 3)


def main() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    lens = [4096, 1500, 777, 2048, 100, 513, 512, 1]
    cu = torch.tensor([0, *lens]).cumsum(0)
    t, heads, kvh, d = int(cu[-1]), 32, 8, 128
    q, k, v = (torch.randn(t, h, d, generator=gen, device=DEV).to(BF16) for h in (heads, kvh, kvh))
    scale = d**-0.5
    layout = cpm.TokenLayout(cu, 2, unit=cpm.cp_unit(DEV))
    idx = [layout.local_index(r) for r in range(2)]
    res: dict = {"tokens": t}
    with rk.mode("strict"):
        ref = rk.attention_varlen(q, k, v, cu.to(DEV), scale)
        res["cp1_ms"] = ms(lambda: rk.attention_varlen(q, k, v, cu.to(DEV), scale))
        parts = [cpm.triton_rank_partials(q, k[i.to(DEV)], v[i.to(DEV)], layout, r, scale) for r, i in enumerate(idx)]
        for r, i in enumerate(idx):
            res[f"rank{r}_partials_ms"] = ms(
                lambda r=r, i=i: cpm.triton_rank_partials(q, k[i.to(DEV)], v[i.to(DEV)], layout, r, scale)
            )
            res[f"rank{r}_partial_rows"] = int(parts[r][0].shape[0])
        for r, i in enumerate(idx):  # what rank r receives: every rank's partials of its queries
            mine = [(p[(m[:, 0] == r).to(DEV)], m[m[:, 0] == r]) for p, m in parts]
            payload, meta = torch.cat([p for p, _ in mine]), torch.cat([m for _, m in mine])
            res[f"rank{r}_received_mb"] = round(payload.numel() * 4 / 1e6, 1)
            out = cpm.triton_fold(payload, meta, layout.positions[i], BF16)
            res[f"rank{r}_fold_ms"] = ms(
                lambda p=payload, m=meta, i=i: cpm.triton_fold(p, m, layout.positions[i], BF16)
            )
            res[f"rank{r}_vs_cp1_mismatch"] = bit_mismatches(out, ref[i.to(DEV)])
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        )
        with prof:
            cpm.triton_rank_partials(q, k[idx[0].to(DEV)], v[idx[0].to(DEV)], layout, 0, scale)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    for key, val in res.items():
        print(f"{key:28s} {val}")
    print(table)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res | {"profile_rank0_partials": table}, f, indent=1)


if __name__ == "__main__":
    main()
