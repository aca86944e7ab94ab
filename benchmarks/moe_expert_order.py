"""The strict MoE layer's counting sort of (token, slot) rows by expert (`rl_kernel.ops.moe.expert_order`: one scan
of the flat one-hot), timed on the device against the form it replaced (the one-hot [R, E] scanned along its
outer dimension, which the H100 decode profile of Qwen3-30B-A3B shapes put at 4.4 of 12.5 device ms a step), the
one-hot [E, R] scanned along its inner dimension, and `torch.argsort(stable=True)`; every form's result is checked
against the stable sort first.

    python benchmarks/moe_expert_order.py --device cuda   # decode at batch 64 and 256, chunks of 2,048 and 8,192

Prints a table (median of --reps CUDA-event timings, microseconds) and writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from rl_kernel.ops.moe import expert_order

EXPERTS, TOP_K = 128, 8  # Qwen3-30B-A3B


def outer_scan_order(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The replaced form: the same counting sort with the one-hot as [R, E], scanned along dim 0."""
    counts = torch.zeros(experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    one_hot = (flat_ids[:, None] == torch.arange(experts, device=flat_ids.device)).to(torch.int32)
    before = one_hot.cumsum(0, dtype=torch.int32).gather(1, flat_ids[:, None]).squeeze(1) - 1
    place = (torch.cumsum(counts, 0) - counts)[flat_ids] + before
    order = torch.empty_like(place).scatter_(0, place, torch.arange(flat_ids.numel(), device=flat_ids.device))
    return order, place, counts


def inner_scan_order(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The form between the two: the one-hot as [E, R], scanned along dim 1 (a few blocks per 32 rows on CUDA)."""
    counts = torch.zeros(experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    one_hot = (torch.arange(experts, device=flat_ids.device)[:, None] == flat_ids[None, :]).to(torch.int32)
    before = one_hot.cumsum(1, dtype=torch.int32).gather(0, flat_ids[None, :]).squeeze(0) - 1
    place = (torch.cumsum(counts, 0) - counts)[flat_ids] + before
    order = torch.empty_like(place).scatter_(0, place, torch.arange(flat_ids.numel(), device=flat_ids.device))
    return order, place, counts


def argsort_order(flat_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    order = torch.argsort(flat_ids, stable=True)
    place = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(experts, dtype=torch.int64, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids)
    )
    return order, place, counts


FORMS = {
    "expert_order (flat scan)": expert_order,
    "inner-dim scan": inner_scan_order,
    "outer-dim scan (replaced)": outer_scan_order,
    "argsort stable": argsort_order,
}


def time_us(fn, ids: torch.Tensor, reps: int) -> float:
    for _ in range(5):
        fn(ids, EXPERTS)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(ids, EXPERTS)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="64,256,2048,8192", help="tokens per call (TOP_K rows each)")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/moe_expert_order.json")
    args = parser.parse_args()
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
    print(f"expert order of (token, slot) rows, {EXPERTS} experts, top-{TOP_K}, {device}, median of {args.reps} (us)")
    print(f"{'tokens':>7} {'rows':>7} " + " ".join(f"{n:>26}" for n in FORMS))
    for r in rows:
        print(f"{r['tokens']:>7} {r['rows']:>7} " + " ".join(f"{(v or 0):>26.1f}" for v in r["us"].values()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"device": device, "experts": EXPERTS, "top_k": TOP_K, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
