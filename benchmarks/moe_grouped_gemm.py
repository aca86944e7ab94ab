"""The strict MoE layer's grouped expert GEMMs at Qwen3-30B-A3B shapes, per tile shape, against vLLM's fused MoE.

    python benchmarks/moe_grouped_gemm.py [--tokens 256,8192] [--out PATH]

For each token count (a decode batch of 256, a prefill chunk of 8,192), the (token, slot) rows of a uniform
random top-8 routing over 128 experts run the strict gate/up GEMM (rows read through the sorted order, bf16 out)
and the down GEMM (fp32 out) under each candidate tile of `rl_kernel.backends.triton.moe` (BLOCK_M >= 64, so
every tile is the same wgmma chain), and the whole strict expert MLP (`grouped_mlp`: gate/up, SwiGLU, down);
every tile's output bits are checked against the shipped tile's (the one `tile_for` picks for the rows: a tile
must move no bit). Native: vLLM's `fused_experts` (its own tuned tiles, SwiGLU and the top-k weighted sum fused)
on the same rows, when its MoE library (the GPU bundle's `moe` add-on) is installed. Median microseconds of
`triton.testing.do_bench`, weight bandwidth (the experts' bytes over the time: the decode batch reads nearly every
expert) and TFLOP/s. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_kernel.backends.triton import activation, moe  # noqa: E402
from rl_kernel.bits import same_bits  # noqa: E402
from rl_kernel.ops.moe import expert_order  # noqa: E402

HIDDEN, EXPERTS, TOP_K, FFN = 2048, 128, 8, 768
TILES = {
    "64x64x64 w4 s3": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    "64x128x64 w4 s4": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    "64x128x128 w4 s3": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    "64x256x64 w8 s3": {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    "128x128x64 w8 s4": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    "128x256x64 w8 s3": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
}


def _rows(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(tokens x [T, D], ids [T, k], order, counts) of a uniform random top-k routing."""
    x = (torch.randn(tokens, HIDDEN, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).sort(-1).values.cuda()
    order, _, counts = expert_order(ids.reshape(-1), EXPERTS)
    return x, ids, order, counts


def _native(x, ids, gate_up, down):
    try:
        import vllm._moe_C_stable_libtorch  # noqa: F401 - registers torch.ops._moe_C
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError as e:
        print(f"(no native row: vLLM's fused MoE is not installed: {e})")
        return None
    weights = torch.full(ids.shape, 1.0 / TOP_K, dtype=torch.float32, device="cuda")
    return lambda: fused_experts(x, gate_up, down, weights, ids.to(torch.int32))


def _time_tile(x, counts, order, a, gate_up, down, tile) -> dict[str, float]:
    """Median us of the gate/up GEMM, the down GEMM and the whole expert MLP under `tile`."""
    from triton.testing import do_bench

    calls = {
        "gate_up_us": lambda: moe.grouped_linear(x, counts, gate_up, x.dtype, source=order, slots=TOP_K, tile=tile),
        "down_us": lambda: moe.grouped_linear(a, counts, down, torch.float32, tile=tile),
        "mlp_us": lambda: moe.grouped_mlp(x, counts, gate_up, down, source=order, slots=TOP_K, tile=tile),
    }
    return {name: do_bench(call) * 1e3 for name, call in calls.items()}


def main(argv: list[str] | None = None) -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,8192")
    parser.add_argument("--out", default="benchmarks/results/moe_grouped_gemm.json")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    down = (torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    expert_bytes = (gate_up.numel() + down.numel()) * 2
    results = []
    for tokens in map(int, args.tokens.split(",")):
        x, ids, order, counts = _rows(tokens, gen)
        rows = ids.numel()
        shipped = moe.tile_for(rows, EXPERTS)
        flops = 2 * rows * HIDDEN * 3 * FFN
        h_ref = moe.grouped_linear(x, counts, gate_up, x.dtype, source=order, slots=TOP_K, tile=shipped)
        a = activation.silu_and_mul(h_ref)
        y_ref = moe.grouped_linear(a, counts, down, torch.float32, tile=shipped)
        for name, tile in TILES.items():
            h = moe.grouped_linear(x, counts, gate_up, x.dtype, source=order, slots=TOP_K, tile=tile)
            y = moe.grouped_linear(a, counts, down, torch.float32, tile=tile)
            same = same_bits(h, h_ref) and same_bits(y, y_ref)
            times = _time_tile(x, counts, order, a, gate_up, down, tile)
            results.append(
                {
                    "tokens": tokens,
                    "rows": rows,
                    "form": f"strict {name}" + (" (shipped)" if tile == shipped else ""),
                    "same_bits_as_shipped": same,
                    **times,
                }
            )
        native = _native(x, ids, gate_up, down)
        if native is not None:
            results.append(
                {
                    "tokens": tokens,
                    "rows": rows,
                    "form": "native vLLM fused_experts",
                    "same_bits_as_shipped": None,
                    "gate_up_us": None,
                    "down_us": None,
                    "mlp_us": do_bench(native) * 1e3,
                }
            )
        for r in results:
            if r["tokens"] == tokens:
                r["weight_TBps"] = expert_bytes / (r["mlp_us"] * 1e-6) / 1e12
                r["TFLOPps"] = flops / (r["mlp_us"] * 1e-6) / 1e12
    device = torch.cuda.get_device_name(0)
    print(f"grouped expert MLP, Qwen3-30B-A3B shapes (E={EXPERTS}, top-{TOP_K}, D={HIDDEN}, I={FFN}), {device}")
    head = ("tokens", "form", "bits", "gate_up us", "down us", "mlp us", "TB/s", "TF/s")
    print("{:>6} {:<34} {:>5} {:>10} {:>8} {:>8} {:>6} {:>6}".format(*head))
    for r in results:
        bits = "-" if r["same_bits_as_shipped"] is None else ("same" if r["same_bits_as_shipped"] else "DIFF")
        gu = "-" if r["gate_up_us"] is None else f"{r['gate_up_us']:.1f}"
        dn = "-" if r["down_us"] is None else f"{r['down_us']:.1f}"
        print(
            f"{r['tokens']:>6} {r['form']:<34} {bits:>5} {gu:>10} {dn:>8} {r['mlp_us']:>8.1f} "
            f"{r['weight_TBps']:>6.2f} {r['TFLOPps']:>6.0f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "rows": results}, indent=1))
    print(f"wrote {args.out}")
    if not all(r["same_bits_as_shipped"] for r in results if r["same_bits_as_shipped"] is not None):
        sys.exit("a tile moved bits (DIFF above): that tile breaks the grouped GEMM's contract on this device")


if __name__ == "__main__":
    main()
