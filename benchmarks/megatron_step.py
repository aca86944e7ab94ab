"""Training-step time of a Qwen3-0.6B-shaped Megatron-core model, strict (rl_kernel spec) vs native
(Megatron's modules), on CUDA; plus strict TP parity on the same packed batch.

    python benchmarks/megatron_step.py --out results/megatron_step.json [--tp 2] [--layers 28]

One process per GPU (NCCL, world = tp). The checkpoint is random (no download), written once to
--ckpt. Per mode: `warmup` untimed steps, then `steps` timed train steps (forward, backward, Megatron
optimizer step) on the same batch; the JSON holds per-step seconds, medians, tokens/s, and whether
strict logprobs equal `Qwen3Reference`'s at the same TP bit for bit. Exits 0 with a "skipped" JSON
when CUDA is absent.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: all visible GPUs, <= 2)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--seqs", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="native,strict")
    p.add_argument("--ckpt", default="/tmp/qwen3_0p6b_shaped")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="rl_kernel strict backend")
    return p.parse_args()


def _make_checkpoint(path: Path, layers: int) -> Path:
    from rl_kernel.models.tiny import make_tiny_qwen3

    if not (path / "config.json").is_file():
        make_tiny_qwen3(
            path,
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=layers,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
        )
    return path


def _sync() -> None:
    torch.cuda.synchronize()


def _worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    import rl_kernel as rk
    from rl_kernel.integrations.megatron import MegatronPolicy
    from rl_kernel.models.qwen3 import Qwen3Reference
    from vime.loop.consistency import compare
    from vime.trainer.grpo import LossConfig, TrainBatch, score, train_step

    rk.set_backend(args.backend)

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 151936, (args.seq_len,), generator=g).tolist() for _ in range(args.seqs)]
    prompts = [args.prompt_len] * args.seqs
    adv = torch.randn(args.seqs, generator=g).tolist()
    result: dict = {
        "tp": world,
        "tokens_per_step": args.seqs * args.seq_len,
        "layers": args.layers,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backend": args.backend,
    }
    parallel_state.initialize_model_parallel(world, 1)
    for mode in args.modes.split(","):
        policy = MegatronPolicy(args.ckpt, tp=world, mode=mode, lr=1e-6, device="cuda")
        rk.evidence.reset()
        t0 = time.perf_counter()
        old = score(policy, seqs, prompts)
        _sync()
        entry = {
            "logprobs_s": time.perf_counter() - t0,
            "ops": sorted({f"{r['op']}:{r['mode']}:{r['backend']}" for r in rk.evidence.snapshot()}),
        }
        batch = TrainBatch(seqs, prompts, adv, old)
        times, metrics = [], {}
        for i in range(args.warmup + args.steps):
            _sync()
            t0 = time.perf_counter()
            metrics = train_step(policy, batch, LossConfig())
            _sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        entry |= {
            "step_s": times,
            "step_median_s": statistics.median(times),
            "tokens_per_s": result["tokens_per_step"] / statistics.median(times),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "last_metrics": metrics,
        }
        if mode == "strict":
            group = parallel_state.get_tensor_model_parallel_group() if world > 1 else None
            ref = Qwen3Reference.from_pretrained(args.ckpt, group=group, device="cuda")
            ref_lp = ref.sequence_logprobs(seqs, prompts)
            agreement = compare([a.float().cpu() for a in old], [b.float().cpu() for b in ref_lp])
            entry["ref_mismatch_count"], entry["tokens_compared"] = agreement.mismatch_count, agreement.tokens
            del ref
        result[mode] = entry
        del policy
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if "strict" in result and "native" in result:
        result["strict_over_native"] = result["strict"]["step_median_s"] / result["native"]["step_median_s"]
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    args = _args()
    if not torch.cuda.is_available():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"skipped": "CUDA is not available"}))
        print("skipped: CUDA is not available")
        return
    world = args.tp or min(2, torch.cuda.device_count())
    args.ckpt = str(_make_checkpoint(Path(args.ckpt), args.layers))
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(world, args, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
