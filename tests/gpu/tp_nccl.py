"""Deterministic tensor-parallel reductions over NCCL, on two GPUs (run under torchrun).

    torchrun --standalone --nproc_per_node 2 tests/gpu/tp_nccl.py [--json PATH]

With fewer GPUs than ranks (one H200), the ranks share GPUs and talk over gloo instead (NCCL refuses two ranks
on one GPU): the kernels and their bits are the same, only the transport differs; the JSON names it.

Checks, with the backend in force (auto: Triton on CUDA) and Qwen3-8B shapes: row-parallel linear
(K sharded over the ranks) equals the unsharded linear bit for bit (TP-invariance), the strict
all-reduce gives every rank the same bits and equals the rank-order tree, and the vocab-parallel
logprob equals the unsharded one (also with several row chunks, and under the bf16 logit contract).
Native twins (F.linear on the shard + all_reduce; native vocab-parallel logprob) are measured and
reported, not judged.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import rl_kernel as rk
from rl_kernel.backends.torch.numerics import tree_sum
from rl_kernel.bits import bit_mismatches


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    transport = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(transport)
    group = dist.group.WORLD
    rk.set_canonical_tp(world)  # row-parallel K groups of the widest TP: then TP = world equals TP 1
    gen = torch.Generator(device="cuda").manual_seed(0)  # same inputs on every rank
    dev = "cuda"
    results = {}

    def record(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        same = torch.tensor([bit_mismatches(a, b)], device=dev)
        dist.all_reduce(same)
        results[name] = int(same)

    for m, n, k in [(1, 4096, 4096), (128, 4096, 12288), (1024, 4096, 4096)]:
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
        kl = k // world
        xs, ws = x[:, rank * kl : (rank + 1) * kl], w[:, rank * kl : (rank + 1) * kl]
        with rk.mode("strict"):
            full, sharded = rk.row_parallel_linear(x, w, None), rk.row_parallel_linear(xs, ws, group)
        record(f"strict row_parallel == linear  M={m} N={n} K={k}", full, sharded)
        with rk.mode("native"):
            full_n, sharded_n = rk.row_parallel_linear(x, w, None), rk.row_parallel_linear(xs, ws, group)
        record(f"native row_parallel == linear  M={m} N={n} K={k}", full_n, sharded_n)

    parts = torch.randn(world, 1 << 20, generator=gen, device=dev) * 100
    with rk.mode("strict"):
        a, b = rk.all_reduce(parts[rank], group), rk.all_reduce(parts[rank], group)
    gathered = [torch.empty_like(a) for _ in range(world)]
    dist.all_gather(gathered, a)
    record("strict all_reduce == rank-order tree", a, tree_sum(parts.T.contiguous()))
    record("strict all_reduce same on every rank", gathered[0], gathered[-1])
    record("strict all_reduce run twice", a, b)

    d, v = 4096, 151936
    lm = (torch.randn(v, d, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    vl = v // world
    for t in (64, 3000):  # 3000 rows: more than one row chunk per rank
        h = torch.randn(t, d, generator=gen, device=dev).to(torch.bfloat16)
        tg = torch.randint(0, v, (t,), generator=gen, device=dev)
        for mode, logits in (("strict", "float32"), ("strict", "bfloat16"), ("native", "float32")):
            rk.set_logits_dtype(logits)
            with rk.mode(mode):
                full = rk.logprobs(h, lm, tg, 0.9)
                shard = rk.logprobs(h, lm[rank * vl : (rank + 1) * vl], tg, 0.9, vocab_size=v, group=group)
            rk.set_logits_dtype("float32")
            record(f"{mode} vocab-parallel logprobs == unsharded  T={t} V={v} {logits} logits", full, shard)
    h = torch.randn(64, d, generator=gen, device=dev).to(torch.bfloat16)
    cols = slice(rank * vl, (rank + 1) * vl)
    for logits in ("float32", "bfloat16"):  # the engine's full-vocab log-probs, vocab-parallel
        rk.set_logits_dtype(logits)
        with rk.mode("strict"):
            full = rk.log_softmax(rk.linear_fp32(h, lm), 0.9)
            shard = rk.log_softmax(rk.linear_fp32(h, lm[cols]), 0.9, vocab_size=v, group=group)
        rk.set_logits_dtype("float32")
        record(f"strict vocab-parallel log_softmax == unsharded  T=64 V={v} {logits} logits", full[:, cols], shard)
    with rk.mode("native"):
        full = rk.log_softmax(rk.linear_fp32(h, lm), 0.9)
        shard = rk.log_softmax(rk.linear_fp32(h, lm[cols]), 0.9, vocab_size=v, group=group)
    record(f"native vocab-parallel log_softmax == unsharded  T=64 V={v}", full[:, cols], shard)

    if rank == 0:
        print(f"{'check':72s} mismatching elements (summed over ranks)")
        for name, n in results.items():
            print(f"{name:72s} {n}")
        strict_ok = all(n == 0 for name, n in results.items() if name.startswith("strict"))
        print(
            f"TP {'PASS' if strict_ok else 'FAIL'}: strict checks {'all bitwise' if strict_ok else 'MISMATCH'}; "
            f"native mismatches: {sum(n for name, n in results.items() if name.startswith('native'))}"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "world": world,
                        "transport": transport,
                        "backend": rk.get_backend(),
                        "results": results,
                        "pass": strict_ok,
                    },
                    f,
                    indent=1,
                )
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if rank != 0 or all(n == 0 for k_, n in results.items() if k_.startswith("strict")) else 1)


if __name__ == "__main__":
    main()
