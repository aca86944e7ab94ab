"""Issue 11 on two GPUs: strict CP under the Triton backend, and the weight push over CUDA IPC and NCCL.

    python tests/gpu/gpu_path.py --json PATH [--layers 36] [--skip-cp] [--skip-push]

Spawns three processes (torch.multiprocessing; no vLLM, Ray or megatron-core needed): trainer ranks 0 and 1
(GPU 0 and GPU 1, an NCCL group between them) and one rollout-engine process. A gloo world of the three
carries control messages; NCCL_NVLS_ENABLE=0.

CP (trainer ranks): Qwen3-8B attention shapes (32 q / 8 kv heads, d 128, bf16), a packed batch of
sequences from 1 to 4096 tokens. Strict CP2 (`cp.strict_cp_attention_forward`, Triton split partials +
ordered fold, tokens dealt in 512-key units) must equal CP1 (`rk.attention_varlen`, Triton backend) bit
for bit on every row. Native twins (reported, not judged): CP2 folding 64-key chunk partials instead of
512-key splits; native CP (gathered-KV SDPA) against native CP1 SDPA. Times: CP1 and CP2 forward (ms).

Push: a Qwen3-8B-shaped bf16 state (36 layers, vocab 151936, untied head: 16.4 GB; `--layers` scales
it), version-dependent random bits, held as TP2 shards by the two trainer ranks, all-gathered over NCCL
(timed) and pushed by trainer rank 0 (`rl_kernel.weights.transfer.WeightSender`) into the engine's
`Qwen3Reference` (`receiver_for_model`): over CUDA IPC with the engine on GPU 0 (colocated), then over
NCCL with the engine on GPU 1. Two versions per transport (cold, warm). The engine checks every received
weight's bits against the expected ones and acknowledges the version; the sender checks the ack.
Prints a table and writes JSON; exit status 1 if a strict check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import rl_kernel as rk  # noqa: E402
from rl_kernel.integrations.megatron import cp as cpm  # noqa: E402
from rl_kernel.models.qwen3 import Qwen3Config, Qwen3Reference  # noqa: E402
from rl_kernel.weights.transfer import WeightSender, receiver_for_model  # noqa: E402

ENGINE = 2  # global rank of the engine process
BF16 = torch.bfloat16


def qwen3_8b(layers: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    )


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


def timed(fn, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


# ---- CP ----------------------------------------------------------------------------------------------------


def cp_check(rank: int, group) -> dict:
    dev = torch.device("cuda", rank)
    gen = torch.Generator(device=dev).manual_seed(0)  # the same batch on both ranks
    lens = [4096, 1500, 777, 2048, 100, 513, 512, 1]
    cu = torch.tensor([0, *lens]).cumsum(0)
    t, heads, kvh, d = int(cu[-1]), 32, 8, 128
    q = torch.randn(t, heads, d, generator=gen, device=dev).to(BF16)
    k = torch.randn(t, kvh, d, generator=gen, device=dev).to(BF16)
    v = torch.randn(t, kvh, d, generator=gen, device=dev).to(BF16)
    scale = d**-0.5
    cu_dev = cu.to(dev)
    layout = cpm.TokenLayout(cu, 2, unit=cpm.cp_unit(dev))
    idx = layout.local_index(rank).to(dev)
    ql, kl, vl = q[idx], k[idx], v[idx]
    res: dict = {"tokens": t, "unit": layout.unit, "local_tokens": int(idx.numel())}
    with rk.mode("strict"):
        ref = rk.attention_varlen(q, k, v, cu_dev, scale)
        out = cpm.cp_attention(ql, kl, vl, layout, scale, group, True, "triton")
        twin = cpm._triton_cp_forward(ql, kl, vl, layout, scale, group, split_chunks=1)
        res["cp1_ms"] = timed(lambda: rk.attention_varlen(q, k, v, cu_dev, scale))
        res["cp2_ms"] = timed(lambda: cpm.cp_attention(ql, kl, vl, layout, scale, group, True, "triton"))
    with rk.mode("native"):
        nref = rk.attention_varlen(q, k, v, cu_dev, scale)
        nout = cpm.cp_attention(ql, kl, vl, layout, scale, group, False)
    counts = torch.tensor(
        [mismatches(out, ref[idx]), mismatches(twin, ref[idx]), mismatches(nout, nref[idx]), out.numel()], device=dev
    )
    dist.all_reduce(counts, group=group)
    res |= {
        "strict_cp2_vs_cp1_mismatch": int(counts[0]),
        "twin_chunk_fold_mismatch": int(counts[1]),
        "native_cp2_vs_cp1_mismatch": int(counts[2]),
        "elements": int(counts[3]),
    }
    # the backward runs (no bit contract): gradients exist and are finite
    qg, kg, vg = (x.clone().requires_grad_() for x in (ql, kl, vl))
    with rk.mode("strict"):
        cpm.cp_attention(qg, kg, vg, layout, scale, group, True, "triton").float().square().sum().backward()
    res["backward_finite"] = bool(all(torch.isfinite(x.grad).all() for x in (qg, kg, vg)))
    return res


# ---- weight push -------------------------------------------------------------------------------------------


def full_tensor(i: int, shape: tuple[int, ...], version: int, dev: torch.device) -> torch.Tensor:
    """Weight i of `version`: random bits (a bf16 view of random int16), the same wherever it is made."""
    g = torch.Generator(device=dev).manual_seed(1_000_003 * version + i)
    return torch.randint(-32768, 32767, shape, dtype=torch.int16, generator=g, device=dev).view(BF16)


def layout_of(layers: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    meta = Qwen3Reference(qwen3_8b(layers), device="meta")
    return [(n, s.full_shape, s.dim) for n, s in meta._shards.items()]


def send_obj(obj, dst: int) -> None:
    dist.send_object_list([obj], dst=dst)


def recv_obj(src: int):
    box = [None]
    dist.recv_object_list(box, src=src)
    return box[0]


def trainer_push(rank: int, tgroup, pgroup, transport: str, versions: list[int], layers: int) -> list[dict]:
    dev = torch.device("cuda", rank)
    names = layout_of(layers)
    sender = WeightSender(transport, lambda m: send_obj(m, ENGINE), lambda: recv_obj(ENGINE), group=pgroup, src=0)
    stats = []
    for version in versions:
        shards = []
        for i, (_, shape, dim) in enumerate(names):  # this rank's TP2 shard of every weight
            full = full_tensor(i, shape, version, dev)
            shards.append(full if dim is None else full.chunk(2, dim)[rank].contiguous())
            del full
        torch.cuda.synchronize(dev)
        dist.barrier(group=tgroup)
        t0 = time.perf_counter()
        gathered = []
        for (name, _, dim), shard in zip(names, shards):  # TP shards gathered: a bit copy
            if dim is None:
                gathered.append((name, shard))
                continue
            parts = [torch.empty_like(shard) for _ in range(2)]
            dist.all_gather(parts, shard, group=tgroup)
            if rank == 0:
                gathered.append((name, torch.cat(parts, dim)))
        torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        del shards
        if rank == 0:
            ack = sender.push(gathered, version)
            t2 = time.perf_counter()
            gb = ack["bytes"] / 1e9
            stats.append(
                {
                    "transport": transport,
                    "version": version,
                    "gb": gb,
                    "gather_s": t1 - t0,
                    "push_s": t2 - t1,
                    "push_gbps": gb / (t2 - t1),
                    "buckets": ack["buckets"],
                    "tensors": ack["tensors"],
                    "acked": ack["version"],
                }
            )
        del gathered
        torch.cuda.empty_cache()
        dist.barrier(group=tgroup)
    return stats


def engine_receive(device: torch.device, pgroup, versions: list[int], layers: int, start_version: int) -> dict:
    torch.cuda.set_device(device)
    model = Qwen3Reference(qwen3_8b(layers), device=device)
    rx = receiver_for_model(model, version=start_version, group=pgroup, src=0)
    names = layout_of(layers)
    bad = {}
    for version in versions:
        while True:
            ack = rx.handle(recv_obj(0))
            if ack is not None:
                break
        send_obj(ack, 0)  # acknowledged on receipt; the bit check below is outside the sender's timing
        wrong = 0
        for i, (name, shape, dim) in enumerate(names):
            s = model._shards[name]
            local = s.local if dim is None else s.local.narrow(dim, 0, shape[dim])
            wrong += mismatches(local, full_tensor(i, shape, version, device))
        bad[version] = wrong
    del model
    torch.cuda.empty_cache()
    return {"received_bits_wrong": bad}


# ---- processes ---------------------------------------------------------------------------------------------


def worker(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank if rank < 2 else 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    tgroup = dist.new_group([0, 1], backend="nccl")
    pgroup = dist.new_group([0, ENGINE], backend="nccl")
    result: dict = {"rank": rank}
    try:
        if rank < 2:
            warm = torch.ones(1, device="cuda")
            dist.all_reduce(warm, group=tgroup)
            if not args.skip_cp:
                result["cp"] = cp_check(rank, tgroup)
        dist.barrier()
        if not args.skip_push:
            if rank < 2:
                result["ipc"] = trainer_push(rank, tgroup, pgroup, "ipc", [1, 2], args.layers)
            else:
                result["ipc_engine"] = engine_receive(torch.device("cuda", 0), pgroup, [1, 2], args.layers, 0)
            dist.barrier()
            if rank == 0 or rank == ENGINE:  # NCCL communicator set up before the timed pushes
                torch.cuda.set_device(0 if rank == 0 else 1)
                warm = torch.ones(1, device="cuda")
                dist.broadcast(warm, 0, group=pgroup)
            if rank < 2:
                result["nccl"] = trainer_push(rank, tgroup, pgroup, "nccl", [3, 4], args.layers)
            else:
                result["nccl_engine"] = engine_receive(torch.device("cuda", 1), pgroup, [3, 4], args.layers, 2)
    except Exception as e:  # recorded, then re-raised so the process fails visibly
        result["error"] = f"{type(e).__name__}: {e}"
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        raise
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def report(results: list[dict], args: argparse.Namespace) -> tuple[dict, bool]:
    ok = all("error" not in r for r in results)
    summary: dict = {"errors": [r["error"] for r in results if "error" in r]}
    print(f"{'check':58s} {'result':>14s}")
    if not args.skip_cp and "cp" in results[0]:
        c = results[0]["cp"]
        summary["cp"] = c
        good = c["strict_cp2_vs_cp1_mismatch"] == 0 and c["backward_finite"]
        ok &= good
        print(
            f"{'strict CP2 == CP1 (Triton), mismatched elements':58s} {c['strict_cp2_vs_cp1_mismatch']:>14d}"
            f"  {'PASS' if good else 'FAIL'}  of {c['elements']}, {c['tokens']} tokens, unit {c['unit']}"
        )
        print(f"{'twin: CP2 folding 64-key chunk partials':58s} {c['twin_chunk_fold_mismatch']:>14d}")
        print(f"{'twin: native CP2 vs native CP1 (SDPA)':58s} {c['native_cp2_vs_cp1_mismatch']:>14d}")
        print(f"{'forward ms: CP1 (one GPU, all tokens) / CP2 (per rank)':58s} {c['cp1_ms']:>6.2f} / {c['cp2_ms']:.2f}")
    if not args.skip_push and "ipc" in results[0]:
        for kind in ("ipc", "nccl"):
            rows = results[0].get(kind, [])
            wrong = results[ENGINE].get(f"{kind}_engine", {}).get("received_bits_wrong", {})
            summary[kind] = {"pushes": rows, "received_bits_wrong": wrong}
            for r in rows:
                w = wrong.get(str(r["version"]), wrong.get(r["version"], -1))
                good = w == 0 and r["acked"] == r["version"]
                ok &= good
                print(
                    f"{kind + ' push v' + str(r['version']) + ': GB / gather s / push s / GB/s / bits wrong':58s} "
                    f"{r['gb']:.2f} / {r['gather_s']:.3f} / {r['push_s']:.3f} / {r['push_gbps']:.1f} / {w}"
                    f"  {'PASS' if good else 'FAIL'}"
                )
    print(f"RESULT {'PASS' if ok else 'FAIL'}")
    summary["pass"] = ok
    return summary, ok


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--skip-cp", action="store_true")
    p.add_argument("--skip-push", action="store_true")
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        print("gpu_path needs two GPUs")
        sys.exit(2)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir = Path(os.environ.get("TMPDIR", "/tmp"), f"gpu_path_{os.getpid()}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = mp.spawn(worker, args=(port, args, str(out_dir)), nprocs=3, join=False)
    try:
        while not ctx.join():
            pass
    except Exception as e:
        print(f"a process failed: {e}")
        for proc in ctx.processes:  # the others may wait on it forever
            if proc.is_alive():
                proc.kill()
    results = [
        json.loads(f.read_text()) if (f := out_dir / f"rank{r}.json").exists() else {"error": "no result"}
        for r in range(3)
    ]
    summary, ok = report(results, args)
    summary["wall_s"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"summary": summary, "ranks": results}, indent=1, default=str))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
