"""Strict (rl_kernel Triton backend) vs native kernels on one GPU: prints a table, writes JSON.

    python benchmarks/kernels.py [--json PATH] [--md PATH] [--quick]

Rows (Qwen3-8B shapes, bf16): GEMM at M in {1, 16, 128, 1024, 8192} for the qkv, o, gate_up and
down projections vs cuBLAS (and the GEMM's two schedules and a few tile shapes, with a bit check
between them); RMSNorm; QK-norm + RoPE (`--only rope`, also at Qwen3-30B-A3B's heads); attention
prefill at 4k / 16k tokens vs PyTorch SDPA; paged decode at batch
1 / 64 / 256 with 4k context vs a native paged decode (gather + SDPA); linear-logprob at V = 151936
(forward, and forward + backward with the fp32 logits kept or recomputed: time and peak memory) vs
F.linear + log_softmax + gather. The whole training step is
benchmarks/train_step.py. Times are medians of `triton.testing.do_bench`
(CUDA events) after warm-up, with inputs rotated when they would fit in L2. `floor_ms` is the larger
of flops / bf16 dense peak and bytes / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rl_kernel as rk  # noqa: E402
from rl_kernel.backends.triton import attention, gemm, logprob, norm  # noqa: E402
from rl_kernel.bits import same_bits  # noqa: E402
from rl_kernel.ops.norm import native_rms_norm  # noqa: E402
from rl_kernel.ops.rope import native_rope  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 datasheet (a lead, not a measurement)
L2_BYTES = 50 << 20
ROWS: list[dict] = []
QUICK = False


def bench(fn, warmup=5, rep=25) -> float:
    if QUICK:
        warmup, rep = 3, 10
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, rep=25) -> float:
    """Median replay time of a CUDA graph of `fn`: its GPU time without the host's launch overhead."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, rep=rep)


def rotating(make, nbytes: int):
    """`make()` -> args; enough copies that they overflow L2; returns a function cycling through them."""
    copies = [make() for _ in range(max(1, min(4, math.ceil(3 * L2_BYTES / max(nbytes, 1)))))]
    state = {"i": 0}

    def next_args():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    return next_args


def row(
    group: str,
    case: str,
    strict_ms: float,
    native_ms: float | None,
    floor_ms: float | None = None,
    target: str = "",
    **extra,
) -> dict:
    r = {
        "group": group,
        "case": case,
        "strict_ms": round(strict_ms, 4),
        "native_ms": None if native_ms is None else round(native_ms, 4),
        "native_over_strict": None if native_ms is None else round(native_ms / strict_ms, 3),
        "floor_ms": None if floor_ms is None else round(floor_ms, 4),
        "target": target,
        **extra,
    }
    ROWS.append(r)
    nat = "-" if native_ms is None else f"{native_ms:.4f}"
    print(
        f"{group:9s} {case:34s} strict {strict_ms:9.4f} ms  native {nat:>9} ms  x{r['native_over_strict']}  {target}",
        flush=True,
    )
    return r


def copy_bandwidth() -> float:
    a = torch.empty(1 << 29, dtype=torch.uint8, device=DEV).random_(0, 255)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3)


# ---- GEMM -----------------------------------------------------------------------------------------------

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def _gemm_case(name: str, m: int, n: int, k: int, bw: float) -> None:
    w_bytes = n * k * 2
    args = rotating(
        lambda: (torch.randn(m, k, device=DEV).to(BF16), (torch.randn(n, k, device=DEV) * 0.02).to(BF16)),
        w_bytes + m * k * 2,
    )
    flops = 2 * m * n * k
    floor = max(flops / PEAK_BF16, (w_bytes + m * k * 2 + m * n * 2) / bw) * 1e3
    native = bench(lambda: F.linear(*args()))
    strict = bench(lambda: gemm.linear(*args()))
    target = ">=0.85x cuBLAS" if m >= 1024 else ">=0.7x cuBLAS"
    extra = {
        "tflops_strict": round(flops / strict * 1e-9, 1),
        "tflops_native": round(flops / native * 1e-9, 1),
        "server": "cublaslt" if gemm.use_cublaslt(*args()) else "triton",
    }
    for server in ("triton", "cublaslt"):  # both servers of the one-chain contract, and their bits
        extra[f"{server}_ms"] = round(bench(lambda s=server: gemm.linear(*args(), server=s)), 4)  # noqa: B023
    x, w = args()
    extra["servers_bitwise"] = same_bits(gemm.linear(x, w, server="triton"), gemm.linear(x, w, server="cublaslt"))
    if m <= 128:
        alt = "fused" if m <= gemm.SPLIT_MAX_M else "split"
        extra[f"{alt}_schedule_ms"] = round(bench(lambda: gemm.linear(*args(), schedule=alt)), 4)
        x, w = args()
        fused, split = gemm.linear(x, w, schedule="fused"), gemm.linear(x, w, schedule="split")
        extra["schedules_bitwise"] = same_bits(fused, split)
    row("gemm", f"{name} M={m} N={n} K={k}", strict, native, floor, target, **extra)


def bench_gemm(bw: float) -> None:
    for name, (n, k) in SHAPES.items():
        for m in (1, 16, 128, 1024, 8192):
            _gemm_case(name, m, n, k, bw)
    # op-level (what the model calls today: fp32 kernel output, then a separate rounding pass)
    x, w = torch.randn(8192, 4096, device=DEV).to(BF16), (torch.randn(4096, 4096, device=DEV) * 0.02).to(BF16)
    with rk.mode("strict"):
        op = bench(lambda: rk.linear(x, w))
    row("gemm", "rk.linear o M=8192 (op path)", op, bench(lambda: F.linear(x, w)), None, "op overhead")


def bench_tiles() -> None:
    """Triton tiles for the one-chain GEMM at decode-sized M (o and down projections): time, and whether the bits
    equal the cuBLASLt server's (a tile's shape must move no bit)."""
    variants = [
        (64, 32, 64, 4, 5),
        (64, 32, 128, 4, 4),
        (64, 16, 128, 4, 4),
        (64, 64, 64, 4, 4),
        (64, 64, 128, 4, 3),
        (64, 32, 256, 4, 3),
        (128, 128, 64, 8, 4),
        (128, 64, 64, 4, 4),
        (128, 32, 128, 4, 4),
        (64, 128, 64, 4, 4),
    ]
    for name, m_values in (("o", (1, 16, 128)), ("down", (1, 16, 128)), ("qkv", (64, 128)), ("gate_up", (64, 128))):
        n, k = SHAPES[name]
        for m in m_values:
            x, w = torch.randn(m, k, device=DEV).to(BF16), (torch.randn(n, k, device=DEV) * 0.02).to(BF16)
            cublas = bench(lambda: F.linear(x, w))  # noqa: B023 (called right here)
            ref = gemm.linear(x, w, server="cublaslt") if rk.backends.triton.cublaslt_ready() else None
            for bm, bn, bk, warps, stages in variants:
                t = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                case = f"{name} M={m} {bm}x{bn}x{bk} w{warps} s{stages}"
                try:
                    out = gemm.linear(x, w, tile=t)
                    ms = bench(lambda t=t: gemm.linear(x, w, tile=t))  # noqa: B023
                    row(
                        "tile",
                        case,
                        ms,
                        cublas,
                        None,
                        "",
                        bits_equal_cublaslt=None if ref is None else same_bits(out, ref),
                    )
                except Exception as e:  # a tile that does not compile (registers, shared memory) is a result too
                    ROWS.append({"group": "tile", "case": case, "error": repr(e)[:200]})
                    print(f"tile      {case}: {e!r}"[:200], flush=True)


# ---- RMSNorm ------------------------------------------------------------------------------------------


def bench_norm(bw: float) -> None:
    """Device time under a CUDA graph (decode norms are a few microseconds: host launch cost would hide them):
    the layer norms with their residual at a decode batch of 1 and 128 and a training micro-batch of 8192,
    and QK-norm of 128 decode tokens read in place from the fused QKV. Native: torch's RMSNorm (HF Qwen3)."""
    for t in (1, 128, 8192):
        _norm_case(t, bw)
    qkv = torch.randn(128, 48 * 128, device=DEV).to(BF16)
    q, w = qkv[:, : 32 * 128].view(128, 32, 128), torch.randn(128, device=DEV).to(BF16)
    strict = graph_ms(_repeat(lambda: norm.rms_norm(q, w, 1e-6)), rep=50) / REPEAT
    native = graph_ms(_repeat(lambda: native_rms_norm(q, w, 1e-6)), rep=50) / REPEAT
    row("rms_norm", "QK-norm q [128, 32, 128] of QKV", strict, native, None, "", graphed=True)


REPEAT = 20  # calls per captured graph: graph launch cost spread thin


# ---- QK-norm + RoPE -----------------------------------------------------------------------------------


def bench_rope(bw: float) -> None:
    """QK-norm + RoPE in one launch, q and k heads read in place from the fused QKV, at a decode batch (256) and a
    prefill chunk (8,192 tokens) of Qwen3-8B (32 + 8 heads) and Qwen3-30B-A3B (32 + 4): angles from the cached
    table (shipped) and computed in the kernel (the form before it; the same bits, checked). Device time under a
    CUDA graph. Native: torch's RMSNorm per head group then torch's rope (HF's eager ops: vLLM fuses these in its
    compiled graph, so this baseline is weaker than native vLLM's); the floor reads qk and writes the result once."""
    for arch, kv_heads in (("qwen3_8b", 8), ("qwen3_30b_a3b", 4)):
        for t in (256, 8192):
            _rope_case(arch, t, 32, kv_heads, bw)


def _rope_case(arch: str, t: int, q_heads: int, kv_heads: int, bw: float) -> None:
    from rl_kernel.backends.triton import rope

    qkv = torch.randn(t, (q_heads + 2 * kv_heads) * 128, device=DEV).to(BF16)
    qk = qkv[:, : (q_heads + kv_heads) * 128].view(t, q_heads + kv_heads, 128)
    wq, wk = (torch.randn(128, device=DEV).to(BF16) for _ in range(2))
    pos = torch.randint(0, 4096, (t,), device=DEV)

    def fused(use_table: bool):
        return lambda: rope.qk_norm_rope(qk, wq, wk, q_heads, 1e-6, pos, 1e6, 128, use_table=use_table)

    def native():
        normed = [native_rms_norm(qk[:, :q_heads], wq, 1e-6), native_rms_norm(qk[:, q_heads:], wk, 1e-6)]
        return native_rope(torch.cat(normed, 1), pos, 1e6, 128)

    same = same_bits(fused(True)(), fused(False)())
    floor = 2 * qk.numel() * 2 / bw * 1e3
    reps = REPEAT if t <= 256 else 4
    try:
        native_ms = graph_ms(_repeat_n(native, reps), rep=50) / reps
    except RuntimeError as e:  # the strict rows still count
        print(f"BENCH qk_norm_rope native {arch} T={t} failed: {e!r}"[:300], flush=True)
        native_ms = None
    for name, use_table in (("table", True), ("computed angles", False)):
        strict = graph_ms(_repeat_n(fused(use_table), reps), rep=50) / reps
        case = f"{arch} T={t} {q_heads}+{kv_heads} heads, {name}"
        row("qk_norm_rope", case, strict, native_ms, floor, "", graphed=True, bits_equal_table_computed=same)


def _repeat_n(fn, n: int):
    def many():
        for _ in range(n):
            fn()

    return many


def _repeat(fn):
    return _repeat_n(fn, REPEAT)


def _norm_case(t: int, bw: float) -> None:
    x, res = (torch.randn(t, 4096, device=DEV).to(BF16) for _ in range(2))
    w = torch.randn(4096, device=DEV).to(BF16)
    floor = (4 * t * 4096 * 2) / bw * 1e3  # read x and residual, write the sum and y
    strict = graph_ms(_repeat(lambda: norm.rms_norm_residual(x, res, w, 1e-6)), rep=50) / REPEAT
    native = graph_ms(_repeat(lambda: native_rms_norm(x + res, w, 1e-6)), rep=50) / REPEAT
    row("rms_norm", f"T={t} D=4096 +residual", strict, native, floor, "", graphed=True)


# ---- attention ----------------------------------------------------------------------------------------


def bench_prefill(bw: float) -> None:
    for t in (4096, 16384):
        _prefill_case(t)


def _prefill_case(t: int, h: int = 32, hkv: int = 8, d: int = 128) -> None:
    q, k, v = (torch.randn(t, n, d, device=DEV).to(BF16) for n in (h, hkv, hkv))
    cu = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    strict = bench(lambda: attention.varlen_attention(q, k, v, cu, d**-0.5))
    qt, kt, vt = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
    native = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=d**-0.5, enable_gqa=True))
    flops = 2 * t * t * h * d  # causal: half of 4 T^2 H d
    ref = attention.varlen_attention(q, k, v, cu, d**-0.5)
    configs = {}  # other launch configurations: time, and whether the bits equal the default's (they must)
    for bm, warps, stages, flat, heavy, tma in (
        (128, 8, 3, False, False, False),
        (64, 4, 3, True, True, False),
        (64, 4, 2, True, True, True),
        (64, 4, 3, True, True, True),
        (64, 4, 4, True, True, True),
        (128, 8, 2, True, True, True),
        (128, 8, 3, True, True, True),
        (128, 8, 4, True, True, True),
        (64, 4, 3, True, False, True),
        (128, 8, 3, True, False, True),
    ):
        cfg = {"BLOCK_M": bm, "num_warps": warps, "num_stages": stages, "FLAT": flat, "HEAVY_FIRST": heavy, "TMA": tma}
        name = (
            f"{bm}/w{warps}/s{stages}"
            + ("/flat" if flat else "/nested")
            + ("/heavy-first" if heavy else "")
            + ("/tma" if tma else "")
        )
        try:
            out = attention.varlen_attention(q, k, v, cu, d**-0.5, config=cfg)
            ms = bench(lambda c=cfg: attention.varlen_attention(q, k, v, cu, d**-0.5, config=c))
            configs[name] = {"ms": round(ms, 4), "bits_equal_default": same_bits(out, ref)}
        except Exception as e:
            configs[name] = repr(e)[:120]
    row(
        "attn",
        f"prefill T={t} (32/8 heads, d=128)",
        strict,
        native,
        flops / PEAK_BF16 * 1e3,
        ">=0.6x SDPA",
        tflops_strict=round(flops / strict * 1e-9, 1),
        tflops_native=round(flops / native * 1e-9, 1),
        configs=configs,
    )
    print(
        "          launch configurations:",
        ", ".join(
            f"{k} {v['ms'] if isinstance(v, dict) else v}"
            + ("" if not isinstance(v, dict) or v["bits_equal_default"] else " BITS DIFFER")
            for k, v in configs.items()
        ),
        flush=True,
    )


def bench_decode(bw: float) -> None:
    # (batch, context, block-table width in tokens): the last as vLLM serves 512-token contexts in an engine of
    # max_model_len 4096 (a table row of 256 blocks, 8 KV splits of which 7 hold no key); 1280 keys: about the mean
    # context of the mixed rollout (prompts of 64-2,048 tokens, 256 new)
    cases = ((1, 4096, 4096), (64, 4096, 4096), (256, 4096, 4096), (128, 512, 512), (128, 512, 4096))
    for b, ctx, width in cases + ((64, 1280, 4096), (256, 1280, 4096)):
        _decode_case(b, bw, ctx=ctx, width=width)
        torch.cuda.empty_cache()


def _decode_case(
    b: int, bw: float, h: int = 32, hkv: int = 8, d: int = 128, ctx: int = 4096, page: int = 16, width: int = 4096
) -> None:
    nblk = b * width // page
    kc = torch.randn(nblk, page, hkv, d, device=DEV).to(BF16)
    vc = torch.randn_like(kc)
    table = torch.randperm(nblk, device=DEV).to(torch.int32).view(b, width // page)
    seq_lens = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
    qsl = torch.arange(b + 1, device=DEV, dtype=torch.int32)
    q = torch.randn(b, h, d, device=DEV).to(BF16)
    strict = bench(lambda: attention.paged_attention(q, kc, vc, table, seq_lens, qsl, d**-0.5))
    fused = bench(lambda: attention.paged_attention(q, kc, vc, table, seq_lens, qsl, d**-0.5, schedule="fused"))
    split = bench(lambda: attention.paged_attention(q, kc, vc, table, seq_lens, qsl, d**-0.5, schedule="split"))

    def native_paged():
        k = kc[table[:, : ctx // page].long()].view(b, ctx, hkv, d).transpose(1, 2)
        v = vc[table[:, : ctx // page].long()].view(b, ctx, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=d**-0.5, enable_gqa=True)

    native = bench(native_paged)
    # a 16-row tile (4 tokens x the 4 query heads of a kv head) instead of 64: no bit depends on the row tile, and a
    # decode batch fills 4 of a tile's rows either way
    small = dict(attention.PAGED, BLOCK_M=16)
    out16 = attention._run(q, kc, vc, qsl, seq_lens, table, page, d**-0.5, True, None, config=small)
    tile16 = bench(lambda: attention._run(q, kc, vc, qsl, seq_lens, table, page, d**-0.5, True, None, config=small))
    default = attention.paged_attention(q, kc, vc, table, seq_lens, qsl, d**-0.5)

    def timed_launches(kc, vc, table, page: int, variants: dict[str, tuple[dict, str | None]]) -> dict:
        """Each named (PAGED overrides, schedule) over the cache kc, vc: time, and whether its bits equal the
        default launch's (they must)."""
        times = {}
        for name, (overrides, schedule) in variants.items():
            cfg = dict(attention.PAGED, **overrides)
            run = lambda: attention._run(q, kc, vc, qsl, seq_lens, table, page, d**-0.5, True, schedule, config=cfg)  # noqa: B023, E731
            times[name] = {"ms": round(bench(run), 4), "same_bits": same_bits(run(), default)}
        return times

    # other warps / pipeline stages of the default tile
    launches = timed_launches(
        kc, vc, table, page,
        {f"w{w}s{s}": ({"num_warps": w, "num_stages": s}, None) for w, s in ((4, 3), (8, 2), (8, 3), (2, 2))},
    )  # fmt: skip
    kv_bytes = 2 * b * ctx * hkv * d * 2
    # the strict CUDA engine's pages (STRICT_CUDA_BLOCK_SIZE = attention.CHUNK = 64 tokens): the same keys, each
    # 64-key chunk one block, read by one TMA box (16-token pages: pointer loads through the block table)
    kc64, vc64, table64 = _repaged(kc, vc, table, page, attention.CHUNK)
    tma = lambda: attention.paged_attention(q, kc64, vc64, table64, seq_lens, qsl, d**-0.5)  # noqa: E731
    pages64 = bench(tma)
    pages64_same_bits = same_bits(tma(), default)
    # other launches over the 64-token pages: deeper TMA pipelines and the FLAT loop (one software pipeline over
    # every chunk instead of one per KV split)
    launches64 = timed_launches(
        kc64, vc64, table64, attention.CHUNK,
        {
            "w4s3": ({"num_stages": 3}, None),
            "w4s4": ({"num_stages": 4}, None),
            "w4s2_fused": ({}, "fused"),
            "w4s2_flat_fused": ({"FLAT": True}, "fused"),
            "w4s3_flat_fused": ({"num_stages": 3, "FLAT": True}, "fused"),
        },
    )  # fmt: skip
    # decode runs under CUDA graphs in serving engines: both sides captured, replays timed
    graphs = {
        "strict": graph_ms(lambda: attention.paged_attention(q, kc, vc, table, seq_lens, qsl, d**-0.5)),
        "pages64": graph_ms(tma),
        "native": graph_ms(native_paged),
    }
    row(
        "attn",
        f"paged decode B={b} ctx={ctx}" + (f" table {width}" if width != ctx else ""),
        strict,
        native,
        kv_bytes / bw * 1e3,
        ">=0.8x native paged",
        fused_schedule_ms=round(fused, 4),
        split_schedule_ms=round(split, 4),
        block_m16_ms=round(tile16, 4),
        block_m16_same_bits=same_bits(out16, default),
        launches=launches,
        kv_gbps_strict=round(kv_bytes / strict * 1e-6, 1),
        graph_strict_ms=round(graphs["strict"], 4),
        graph_native_ms=round(graphs["native"], 4),
        graph_native_over_strict=round(graphs["native"] / graphs["strict"], 3),
        pages64_tma_ms=round(pages64, 4),
        pages64_same_bits=pages64_same_bits,
        pages64_launches=launches64,
        graph_pages64_ms=round(graphs["pages64"], 4),
        graph_native_over_pages64=round(graphs["native"] / graphs["pages64"], 3),
        kv_gbps_pages64=round(kv_bytes / pages64 * 1e-6, 1),
    )


def _repaged(kc, vc, table, page: int, new_page: int):
    """The keys of paged caches kc, vc [blocks, page, Hkv, d] (rows of `table`) copied into new caches of
    `new_page`-token blocks in a shuffled order, and their block table."""
    b, width = table.shape[0], table.shape[1] * page
    logical = [c[table.long()].view(b, width, *c.shape[2:]) for c in (kc, vc)]
    order = torch.randperm(b * width // new_page, device=kc.device)
    caches = []
    for keys in logical:
        cache = torch.empty(b * width // new_page, new_page, *keys.shape[2:], dtype=keys.dtype, device=keys.device)
        cache[order] = keys.reshape(-1, new_page, *keys.shape[2:])
        caches.append(cache)
    return caches[0], caches[1], order.view(b, width // new_page).to(torch.int32)


# ---- linear logprob -------------------------------------------------------------------------------------


def extra_peak(fn) -> int:
    """Bytes `fn` allocates at its peak beyond what was allocated before it (a second call, warm)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_logprob(bw: float) -> None:
    """Forward (scoring) and forward + backward (training) of the LM-head logprob at 8192 tokens."""
    from rl_kernel.ops import logprob as logprob_op

    t, d, v = 8192, 4096, 151936
    hid = torch.randn(t, d, device=DEV).to(BF16)
    w = (torch.randn(v, d, device=DEV) * 0.02).to(BF16)
    tg = torch.randint(0, v, (t,), device=DEV)
    temps = torch.ones(t, dtype=torch.float64, device=DEV)
    inputs = hid.numel() * 2 + w.numel() * 2

    def native():
        return torch.log_softmax(F.linear(hid, w).float(), -1).gather(1, tg[:, None]).squeeze(1)

    def strict():
        return logprob.logprobs_and_lse(hid, w, tg, temps, 0, v)[0]

    peaks = {"strict": extra_peak(strict), "native": extra_peak(native)}
    s, n = bench(strict, rep=100), bench(native, rep=100)
    flops = 2 * t * v * d
    variants = {}
    for server in ("triton", "cublaslt"):
        try:
            variants[server] = round(
                bench(lambda s=server: logprob.logprobs_and_lse(hid, w, tg, temps, 0, v, server=s)[0]), 3
            )
        except Exception as e:
            variants[server] = repr(e)[:100]
    saved = logprob.STATE_FRACTION
    for fraction in (4, 6, 24):  # the state budget: speed against peak memory (no bit depends on it)
        logprob.STATE_FRACTION = fraction
        try:
            variants[f"state_1/{fraction}"] = {
                "ms": round(bench(strict), 3),
                "peak_over_inputs": round((inputs + extra_peak(strict)) / inputs, 3),
            }
        finally:
            logprob.STATE_FRACTION = saved
    variants["servers_bitwise"] = same_bits(
        logprob.logprobs_and_lse(hid, w, tg, temps, 0, v, server="triton")[0],
        logprob.logprobs_and_lse(hid, w, tg, temps, 0, v, server="cublaslt")[0],
    )
    row(
        "logprob",
        f"linear-logprob fwd T={t} D={d} V={v}",
        s,
        n,
        max(flops / PEAK_BF16, inputs / bw) * 1e3,
        ">=1.2x native, peak <=1.1x inputs",
        extra_peak_gb_strict=round(peaks["strict"] / 1e9, 3),
        extra_peak_gb_native=round(peaks["native"] / 1e9, 3),
        inputs_gb=round(inputs / 1e9, 3),
        peak_over_inputs_strict=round((inputs + peaks["strict"]) / inputs, 3),
        peak_over_inputs_native=round((inputs + peaks["native"]) / inputs, 3),
        tflops_strict=round(flops / s * 1e-9, 1),
        logit_servers_ms=variants,
    )

    def strict_bf16():  # the bf16 logit contract (rl_kernel.set_logits_dtype): native's own logit rounding
        return logprob.logprobs_and_lse(hid, w, tg, temps, 0, v, logits_dtype=BF16)[0]

    peak = extra_peak(strict_bf16)
    s, n = bench(strict_bf16, rep=100), bench(native, rep=100)
    row(
        "logprob",
        f"linear-logprob fwd T={t} D={d} V={v}, bf16 logits",
        s,
        n,
        max(flops / PEAK_BF16, inputs / bw) * 1e3,
        ">=1.2x native, peak <=1.1x inputs",
        peak_over_inputs_strict=round((inputs + peak) / inputs, 3),
        tflops_strict=round(flops / s * 1e-9, 1),
    )

    hid_g, w_g = hid.clone().requires_grad_(), w.clone().requires_grad_()
    grad = torch.randn(t, device=DEV)

    def native_train():
        out = torch.log_softmax(F.linear(hid_g, w_g).float(), -1).gather(1, tg[:, None]).squeeze(1)
        return torch.autograd.grad(out, (hid_g, w_g), grad)

    def strict_train():
        with rk.mode("strict"):
            out = rk.logprobs(hid_g, w_g, tg, 1.0, v)
        return torch.autograd.grad(out, (hid_g, w_g), grad)

    native_ms, native_peak = bench(native_train, rep=50), extra_peak(native_train)
    # the logits kept for the backward (default) or recomputed there; fp32 logits, and the bf16 logit contract
    for keep, logits in ((True, "float32"), (False, "float32"), (True, "bfloat16")):
        logprob_op.KEEP_LOGITS = keep
        rk.set_logits_dtype(logits)
        try:
            ms, peak = bench(strict_train, rep=50), extra_peak(strict_train)
        finally:
            logprob_op.KEEP_LOGITS = True
            rk.set_logits_dtype("float32")
        kind = f"{'kept' if keep else 'recomputed'} logits{', bf16' if logits == 'bfloat16' else ''}"
        row(
            "logprob",
            f"linear-logprob fwd+bwd T={t} ({kind})",
            ms,
            native_ms,
            3 * max(flops / PEAK_BF16, inputs / bw) * 1e3,
            ">=1.0x native",
            extra_peak_gb_strict=round(peak / 1e9, 3),
            extra_peak_gb_native=round(native_peak / 1e9, 3),
            inputs_gb=round(inputs / 1e9, 3),
            peak_over_inputs_strict=round((inputs + peak) / inputs, 3),
            peak_over_inputs_native=round((inputs + native_peak) / inputs, 3),
        )


def table_md() -> str:
    lines = [
        "| group | case | strict ms | native ms | native/strict | floor ms | target | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        shown = ("group", "case", "strict_ms", "native_ms", "native_over_strict", "floor_ms", "target")
        notes = {k: v for k, v in r.items() if k not in shown}
        lines.append(
            f"| {r['group']} | {r['case']} | {r.get('strict_ms', '')} | {r.get('native_ms', '')} | "
            f"{r.get('native_over_strict', '')} | {r.get('floor_ms', '')} | {r.get('target', '')} | "
            f"{', '.join(f'{k}={v}' for k, v in notes.items())} |"
        )
    return "\n".join(lines)


def main() -> None:
    global QUICK
    p = argparse.ArgumentParser(description="strict vs native kernel benchmarks (one GPU)")
    p.add_argument("--json", default="benchmarks/results/kernels_h200.json")
    p.add_argument("--md", default="benchmarks/results/kernels_h200.md")
    p.add_argument("--only", default="gemm,prefill,decode,logprob,norm,tiles")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    a = p.parse_args()
    QUICK = a.quick
    torch.manual_seed(0)
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"BENCH device {torch.cuda.get_device_name()}  copy {bw / 1e12:.2f} TB/s", flush=True)
    stages = {
        "gemm": bench_gemm,
        "tiles": bench_tiles,
        "norm": bench_norm,
        "rope": bench_rope,
        "prefill": bench_prefill,
        "decode": bench_decode,
        "logprob": bench_logprob,
    }
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_tb_s": round(bw / 1e12, 3),
        "peak_bf16_assumed": PEAK_BF16,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "gemm_tile": gemm.TILE,
        "gemm_lt_min_m": gemm.LT_MIN_M,
        "gemm_split_max_m": gemm.SPLIT_MAX_M,
        "cublaslt_ready": rk.backends.triton.cublaslt_ready(),
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    for name in a.only.split(","):
        fn = stages[name]
        try:
            fn(bw) if fn.__code__.co_argcount else fn()
        except Exception as e:  # one failing row group must not lose the others
            ROWS.append({"group": name, "case": "ERROR", "error": repr(e)[:300]})
            print(f"BENCH {name} failed: {e!r}"[:300], flush=True)
        torch.cuda.empty_cache()
        meta["wall_s"] = round(time.time() - t0, 1)
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": ROWS}, indent=1))  # after every group
        md = table_md()
        Path(a.md).write_text(f"# rl_kernel Triton vs native on {meta['device']}\n\n{json.dumps(meta)}\n\n{md}\n")

    print(f"BENCH done in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
