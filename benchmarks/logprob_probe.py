"""Where the strict linear-logprob forward spends its time on a GPU, and which of its settings pay.

    python3 benchmarks/logprob_probe.py [out.json]                   # benchmarks/results/logprob_probe_h200.*
    python3 benchmarks/logprob_probe.py [out.json] --geometries      # (row chunk, slice) geometries, in rounds

Qwen3-8B's LM head (V 151936, D 4096) over 8192 tokens, bf16, temperature 1 and mixed temperatures, logits
in fp32 and in bf16 (the bf16 logit contract, rl_kernel.set_logits_dtype). Each
setting is timed eagerly (what a caller sees: host launch time included) and as the replay of a CUDA graph of
the same call (GPU time alone), with its bits against the reference setting and its peak memory; then the
cuBLASLt GEMM passes alone and the stats pass alone, both as graph replays. No setting moves a bit
(tests/gpu/test_triton_kernels.py); this says which ones pay and whether the host or the GPU bounds the call.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
from kernels import extra_peak, graph_ms  # benchmarks/kernels.py, beside this file
from triton.testing import do_bench

import rl_kernel  # noqa: F401  (claims cuBLASLt's workspace before any CUDA work)
from rl_kernel.backends.triton import gemm, logprob

DEV, BF16 = "cuda", torch.bfloat16
T, D, V = 8192, 4096, 151936
OUT: dict = {}
OFF = {"FAST_TEMP": False, "RNI": False, "TARGET_LOAD": False}


def bench(fn, rep=60) -> float:
    return do_bench(fn, warmup=5, rep=rep, return_mode="median")


def same(a, b) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def forward_variants(hid, w, tg, temps_by_name, inputs) -> None:
    defaults = {k: getattr(logprob, k) for k in ("ROW_ALIGN", "STATE_FRACTION", "STATS_TILE", "STATS_OPTIONS")}
    variants = {
        "options off, no row alignment": dict(STATS_OPTIONS=OFF, ROW_ALIGN=1),
        "default": {},
        "default, bf16 logits": dict(LOGITS=BF16),
        "default, stats 32x256 w8": dict(STATS_TILE={"BLOCK_M": 32, "BLOCK_N": 256, "num_warps": 8}),
        "default, stats 64x64 w4": dict(STATS_TILE={"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}),
        "default, state 1/9": dict(STATE_FRACTION=9),
    }
    refs, OUT["forward"] = {}, {}
    for name, attrs in variants.items():
        attrs = dict(attrs)
        logits = attrs.pop("LOGITS", torch.float32)
        for tname, temps in temps_by_name.items():
            for k, val in {**defaults, **attrs}.items():
                setattr(logprob, k, val)
            try:

                def fn(temps=temps, logits=logits):
                    return logprob.logprobs_and_lse(hid, w, tg, temps, 0, V, logits_dtype=logits)[0]

                out = fn()
                row = {
                    "eager_ms": round(bench(fn), 3),
                    "graph_ms": round(graph_ms(fn, rep=60), 3),
                    "peak_over_inputs": round((inputs + extra_peak(fn)) / inputs, 3),
                }
            finally:
                for k, val in defaults.items():
                    setattr(logprob, k, val)
            refs.setdefault((tname, logits), out)  # the first setting of the same logit dtype
            row["bits_equal_first"] = same(out, refs[(tname, logits)])
            OUT["forward"][f"{name} / {tname}"] = row
            print(
                f"{name + ' / ' + tname:52s} eager {row['eager_ms']:7.3f} ms  graph {row['graph_ms']:7.3f} ms  "
                f"peak {row['peak_over_inputs']:.3f}x  bits {'equal' if row['bits_equal_first'] else 'DIFFER'}",
                flush=True,
            )


GEOMETRIES = {
    torch.float32: ((1664, 7680), (2048, 5376), (2048, 4096), (1536, 8192), (1024, 12288)),
    BF16: ((1664, 15360), (2048, 10752), (2048, 8192), (1536, 16384)),
}


def geometries(hid, w, tg, ones, inputs, rounds: int = 3) -> None:
    """The forward at fixed (row chunk, slice columns) instead of `_forward_geometry`'s, per logit dtype, timed in
    interleaved rounds (median eager and graph time over the rounds), with peak memory and bits against the
    default geometry's (no bit depends on it)."""
    saved, OUT["geometries"] = logprob._forward_geometry, {}
    runs: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for logits, shapes in GEOMETRIES.items():
            ref = logprob.logprobs_and_lse(hid, w, tg, ones, 0, V, logits_dtype=logits)[0]
            for rows, cols in shapes:
                logprob._forward_geometry = lambda *_, g=(rows, cols): g
                try:

                    def fn(logits=logits):
                        return logprob.logprobs_and_lse(hid, w, tg, ones, 0, V, logits_dtype=logits)[0]

                    key = f"{'bf16' if logits == BF16 else 'fp32'} logits {rows}x{cols}"
                    got = runs.setdefault(key, {"eager": [], "graph": []})
                    got["eager"].append(bench(fn, rep=300))
                    got["graph"].append(graph_ms(fn, rep=300))
                    if r == 0:
                        OUT["geometries"][key] = {
                            "peak_over_inputs": round((inputs + extra_peak(fn)) / inputs, 3),
                            "bits_equal": same(fn(), ref),
                        }
                finally:
                    logprob._forward_geometry = saved
    for key, got in runs.items():
        row = OUT["geometries"][key] | {k: round(sorted(v)[len(v) // 2], 3) for k, v in got.items()}
        OUT["geometries"][key] = row | {"eager_all": [round(x, 3) for x in got["eager"]]}
        bits = "equal" if row["bits_equal"] else "DIFFER"
        print(
            f"geometry {key:28s} eager {row['eager']:7.3f} ms  graph {row['graph']:7.3f} ms  (medians of {rounds} "
            f"rounds)  peak {row['peak_over_inputs']}x  bits {bits}",
            flush=True,
        )


def gemm_and_stats(hid, w, tg, ones, logits=torch.float32) -> None:
    """GPU time (graph replays) of the forward's two passes at its own geometry, logits in `logits`: GEMMs alone,
    stats alone."""
    n_tiles = triton.cdiv(V, 64)
    rows, cols = logprob._forward_geometry(T, w, n_tiles, logit_bytes=logits.itemsize)
    tag = "" if logits == torch.float32 else " (bf16 logits)"

    out = {} if logits == hid.dtype else {"out_dtype": torch.float32}  # bf16: cuBLASLt's epilogue rounds

    def passes():
        with gemm.cublaslt():
            for a in range(0, T, rows):
                for c0 in range(0, V, cols):
                    torch.mm(hid[a : a + rows], w[c0 : c0 + cols].t(), **out)

    OUT["geometry" + tag] = {"rows": rows, "cols": cols, "slices": triton.cdiv(T, rows) * triton.cdiv(V, cols)}
    OUT["gemm_passes_graph_ms" + tag] = round(graph_ms(passes, rep=60), 3)
    if logits == torch.float32:
        with gemm.cublaslt():
            lt_fp32 = graph_ms(lambda: torch.mm(hid, w.t(), out_dtype=torch.float32), rep=60)
        OUT["gemm_full_lt_fp32_graph_ms"] = round(lt_fp32, 3)
        OUT["gemm_full_bf16_graph_ms"] = round(graph_ms(lambda: F.linear(hid, w), rep=60), 3)
    _stats_passes(hid, w, tg, ones, rows, cols, n_tiles, logits, tag)


def _stats_passes(hid, w, tg, ones, rows, cols, n_tiles, logits, tag) -> None:
    """GPU time (graph replays) of the stats pass over the forward's slices of `logits`, per stats setting."""
    with gemm.cublaslt():
        sl = torch.mm(hid[:rows], w[:cols].t(), out_dtype=torch.float32).to(logits)
    m_t = torch.empty(rows, n_tiles, device=DEV)
    s_t = torch.empty(rows, n_tiles, dtype=torch.int64, device=DEV)
    z_t = torch.zeros(rows, device=DEV)
    t32 = ones[:rows].float()
    key = "stats_pass_graph_ms" + tag
    OUT[key] = {}
    for name, opts, tile in (
        ("options off", OFF, logprob.STATS_TILE),
        ("default", logprob.STATS_OPTIONS, logprob.STATS_TILE),
        ("default, 32x256 w8", logprob.STATS_OPTIONS, {"BLOCK_M": 32, "BLOCK_N": 256, "num_warps": 8}),
        ("default, 64x64 w4", logprob.STATS_OPTIONS, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}),
    ):
        launch = dict(tile, VT=64, FIXED=float(1 << 40), LOG2E=logprob.LOG2E, **opts, enable_fp_fusion=False)

        def stats(launch=launch):
            for _ in range(OUT["geometry" + tag]["slices"]):
                logprob._stats_kernel[(triton.cdiv(rows, launch["BLOCK_M"]), triton.cdiv(cols, launch["BLOCK_N"]))](
                    sl, t32, tg, m_t, s_t, z_t, rows, V, 0, cols, sl.stride(0), 0, V, n_tiles, **launch
                )

        OUT[key][name] = round(graph_ms(stats, rep=60), 3)
    print(
        f"geometry{tag} {OUT['geometry' + tag]}; GPU time: GEMM passes {OUT['gemm_passes_graph_ms' + tag]} ms "
        f"(one cuBLASLt fp32 GEMM {OUT.get('gemm_full_lt_fp32_graph_ms')}, cuBLAS bf16 "
        f"{OUT.get('gemm_full_bf16_graph_ms')}); stats pass " + ", ".join(f"{k} {v}" for k, v in OUT[key].items()),
        flush=True,
    )


def main() -> None:
    torch.manual_seed(0)
    hid = torch.randn(T, D, device=DEV).to(BF16)
    w = (torch.randn(V, D, device=DEV) * 0.02).to(BF16)
    tg = torch.randint(0, V, (T,), device=DEV)
    ones = torch.ones(T, dtype=torch.float64, device=DEV)
    mixed = torch.rand(T, dtype=torch.float64, device=DEV) * 0.5 + 0.6
    inputs = hid.numel() * 2 + w.numel() * 2

    def native():
        return torch.log_softmax(F.linear(hid, w).float(), -1).gather(1, tg[:, None]).squeeze(1)

    OUT["native_ms_first"] = round(bench(native), 3)
    OUT["native_graph_ms"] = round(graph_ms(native, rep=60), 3)
    print(f"native: eager {OUT['native_ms_first']} ms, graph {OUT['native_graph_ms']} ms", flush=True)
    if "--geometries" in sys.argv:  # the geometry sweep alone
        geometries(hid, w, tg, ones, inputs)
    else:
        forward_variants(hid, w, tg, {"t=1": ones, "mixed t": mixed}, inputs)
        gemm_and_stats(hid, w, tg, ones)
        gemm_and_stats(hid, w, tg, ones, BF16)
    OUT["native_ms_last"] = round(bench(native), 3)
    print(f"native again {OUT['native_ms_last']} ms", flush=True)
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    if paths:
        with open(paths[0], "w") as f:
            json.dump(OUT, f, indent=1)


if __name__ == "__main__":
    main()
