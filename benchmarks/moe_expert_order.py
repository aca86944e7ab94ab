"""The strict MoE layer's counting sort of (token, slot) rows by expert (`rl_kernel.ops.moe.expert_order`: on CUDA
the Triton dispatch, two launches of per-block counts and ranks), timed on the device against the torch backend's
form (one scan of the flat [E, R] one-hot), the form before it (the one-hot [R, E] scanned along its outer
dimension, which the H100 decode profile of Qwen3-30B-A3B shapes put at 4.4 of 12.5 device ms a step), the one-hot
[E, R] scanned along its inner dimension, and `torch.argsort(stable=True)`; every form's result is checked against
the stable sort first.

    python benchmarks/moe_expert_order.py --device cuda   # decode at batch 64 and 256, chunks of 2,048 and 8,192

Prints a table (median of --reps CUDA-event timings, microseconds, eager and replayed from a CUDA graph) and writes
JSON under benchmarks/results/. `--device cpu` checks the forms against the stable sort and times nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from rl_kernel.backends.torch import moe as torch_moe
from rl_kernel.ops.moe import expert_order

EXPERTS, TOP_K = 128, 8  # Qwen3-30B-A3B


def _counting_sort(flat_ids: torch.Tensor, experts: int, before: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(order, place, counts) from `before`, the rows of each row's expert before it: place = the expert's offset
    + before (the counting sort's earlier form)."""
    counts = torch.zeros(experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    place = (torch.cumsum(counts, 0) - counts)[flat_ids] + before
    order = torch.empty_like(place).scatter_(0, place, torch.arange(flat_ids.numel(), device=flat_ids.device))
    return order, place, counts


def outer_scan_order(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, ...]:
    """The replaced form: the one-hot as [R, E], scanned along dim 0 (one thread per column on CUDA)."""
    one_hot = (flat_ids[:, None] == torch.arange(experts, device=flat_ids.device)).to(torch.int32)
    before = one_hot.cumsum(0, dtype=torch.int32).gather(1, flat_ids[:, None]).squeeze(1) - 1
    return _counting_sort(flat_ids, experts, before)


def inner_scan_order(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, ...]:
    """The form between the two: the one-hot as [E, R], scanned along dim 1 (a few blocks per 32 rows on CUDA)."""
    one_hot = (torch.arange(experts, device=flat_ids.device)[:, None] == flat_ids[None, :]).to(torch.int32)
    before = one_hot.cumsum(1, dtype=torch.int32).gather(0, flat_ids[None, :]).squeeze(0) - 1
    return _counting_sort(flat_ids, experts, before)


def argsort_order(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    order = torch.argsort(flat_ids, stable=True)
    place = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(experts, dtype=torch.int64, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids)
    )
    return order, place, counts


FORMS = {
    "expert_order (Triton dispatch on CUDA)": expert_order,
    "flat scan (torch backend)": torch_moe.dispatch,
    "inner-dim scan": inner_scan_order,
    "outer-dim scan (replaced)": outer_scan_order,
    "argsort stable": argsort_order,
}


def time_us(fn, ids: torch.Tensor, reps: int) -> dict[str, float | None]:
    """Median microseconds of one call: eager (launches included, as a prefill step runs it) and replayed from a
    CUDA graph (as a decode step runs it; None where the form cannot be captured)."""

    def median_us(call) -> float:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture wants
        for _ in range(5):
            fn(ids, EXPERTS)
    torch.cuda.synchronize()
    timed = {"eager": median_us(lambda: fn(ids, EXPERTS))}
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn(ids, EXPERTS)
        timed["graph"] = median_us(graph.replay)
    except RuntimeError as e:
        print(f"  (not capturable: {str(e).splitlines()[0][:100]})")
        timed["graph"] = None
    return timed


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="64,256,2048,8192", help="tokens per call (TOP_K rows each)")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/moe_expert_order.json")
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).reshape(-1)
        ids = ids.to(args.device)
        want = argsort_order(ids, EXPERTS)
        for name, fn in FORMS.items():
            assert all(torch.equal(a, b) for a, b in zip(fn(ids, EXPERTS), want)), f"{name} is not the stable sort"
        timed = {name: time_us(fn, ids, args.reps) if args.device == "cuda" else None for name, fn in FORMS.items()}
        rows.append({"tokens": tokens, "rows": ids.numel(), "us": timed})
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"expert order of (token, slot) rows, {EXPERTS} experts, top-{TOP_K}, {device}, median of {args.reps}")
    print("us a call, eager / replayed from a CUDA graph")
    print(f"{'tokens':>7} {'rows':>7} " + " ".join(f"{n:>26}" for n in FORMS))
    for r in rows:
        cells = [f"{_us(t['eager'])} / {_us(t['graph'])}" if t else "-" for t in r["us"].values()]
        print(f"{r['tokens']:>7} {r['rows']:>7} " + " ".join(f"{c:>26}" for c in cells))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"device": device, "experts": EXPERTS, "top_k": TOP_K, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
