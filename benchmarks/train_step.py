"""A strict training step against the fastest native one, at Qwen3-8B shapes, on 1 GPU or TP over several.

    python benchmarks/train_step.py [--layers 4] [--seqs 4] [--seq-len 2048] [--reps 20] [--json PATH]
    torchrun --nproc_per_node 2 benchmarks/train_step.py --json PATH          # TP2

One model (`DecoderStack`: Qwen3-8B layer shapes, `--layers` decoder layers, final norm, LM-head logprob),
run in two modes in one process:
- native: cuBLAS `F.linear` in bf16, SDPA (its default kernel: cuDNN on the H200 image) on equal-length
  sequences with `is_causal`, `F.rms_norm`, fp32 log-softmax + gather; TP as Megatron does it (all-reduce
  after row-parallel layers, vocab-parallel cross entropy).
- strict: every forward op from rl_kernel under its contract (Triton backend, canonical TP = the TP
  size); backward by rl_kernel's autograd (tensor-core GEMMs, FlashAttention-2 backward).
Phases timed separately with CUDA events: scoring forward (no grad), training forward, backward,
optimizer (fused AdamW, the same for both), and the LM-head logprob alone (forward, forward+backward).
Strict and native repetitions alternate, so both see the same clock and power state; the whole
measurement is taken twice (two passes) and both medians are reported, with their spread. The GPU's
SM clock and power-cap flag are read before and after. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rl_kernel as rk  # noqa: E402

D, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 12288, 151936
EPS, THETA = 1e-6, 1e6


def gpu_state() -> str:
    try:
        return subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,clocks.sm,clocks.max.sm,power.draw,clocks_throttle_reasons.sw_power_cap",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "nvidia-smi unavailable"


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient (column-parallel input, as Megatron)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (row-parallel output, native); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _VocabParallelLogprob(torch.autograd.Function):
    """Native vocab-parallel log p(target) from local fp32 logits [T, V/tp] (Megatron's cross entropy)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        m = logits.amax(-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(logits - m[:, None])
        s = e.sum(-1)
        dist.all_reduce(s, group=group)
        local = targets - vocab_start
        owned = (local >= 0) & (local < logits.shape[-1])
        z_t = torch.where(owned, logits.gather(-1, local.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0], 0.0)
        dist.all_reduce(z_t, group=group)
        ctx.save_for_backward(e, s, local, owned)
        return z_t - m - torch.log(s)

    @staticmethod
    def backward(ctx, g):
        e, s, local, owned = ctx.saved_tensors
        grad = e.div_(s[:, None]).neg_()
        rows = owned.nonzero()[:, 0]
        grad[rows, local[rows]] += 1.0
        return grad.mul_(g[:, None]), None, None, None


def _rope_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, -1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


class DecoderLayer(torch.nn.Module):
    """One Qwen3 decoder layer, this rank's TP shard (columns of qkv/gate_up, rows of o/down)."""

    def __init__(self, tp: int, device: str):
        super().__init__()
        self.heads, self.kv_heads = HEADS // tp, KV_HEADS // tp

        def w(n: int, k: int) -> torch.nn.Parameter:
            return torch.nn.Parameter((torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16))

        def ones(n: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.ones(n, device=device, dtype=torch.bfloat16))

        self.input_norm, self.post_norm, self.q_norm, self.k_norm = ones(D), ones(D), ones(HEAD_DIM), ones(HEAD_DIM)
        self.qkv = w((self.heads + 2 * self.kv_heads) * HEAD_DIM, D)
        self.o = w(D, self.heads * HEAD_DIM)
        self.gate_up = w(2 * INTER // tp, D)
        self.down = w(D, INTER // tp)

    def forward(self, h, residual, batch, strict: bool, group):
        t, d = h.shape[0], HEAD_DIM
        split = [self.heads * d, self.kv_heads * d, self.kv_heads * d]
        if strict:
            h, residual = (
                (rk.rms_norm(h, self.input_norm, EPS), h)
                if residual is None
                else rk.rms_norm(h, self.input_norm, EPS, residual=residual)
            )
            x = h if group is None else _CopyToTP.apply(h, group)
            q, k, v = rk.linear(x, self.qkv).split(split, -1)
            q = rk.rope(rk.rms_norm(q.reshape(t, self.heads, d), self.q_norm, EPS), batch["pos"], THETA)
            k = rk.rope(rk.rms_norm(k.reshape(t, self.kv_heads, d), self.k_norm, EPS), batch["pos"], THETA)
            o = rk.attention_varlen(q, k, v.reshape(t, self.kv_heads, d), batch["cu"], d**-0.5, batch["max_len"])
            h = rk.row_parallel_linear(o.reshape(t, -1), self.o, group)
            h, residual = rk.rms_norm(h, self.post_norm, EPS, residual=residual)
            x = h if group is None else _CopyToTP.apply(h, group)
            return rk.row_parallel_linear(rk.silu_and_mul(rk.linear(x, self.gate_up)), self.down, group), residual
        residual = h if residual is None else h + residual
        x = F.rms_norm(residual, (D,), self.input_norm, EPS)
        x = x if group is None else _CopyToTP.apply(x, group)
        q, k, v = F.linear(x, self.qkv).split(split, -1)
        q = _rope_native(F.rms_norm(q.reshape(t, self.heads, d), (d,), self.q_norm, EPS), batch["cos"], batch["sin"])
        k = _rope_native(F.rms_norm(k.reshape(t, self.kv_heads, d), (d,), self.k_norm, EPS), batch["cos"], batch["sin"])
        b, s = batch["seqs"], t // batch["seqs"]
        qb, kb, vb = (y.reshape(b, s, -1, d).transpose(1, 2) for y in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=d**-0.5, enable_gqa=True)
        h = F.linear(o.transpose(1, 2).reshape(t, -1), self.o)
        h = h if group is None else _ReduceFromTP.apply(h, group)
        residual = h + residual
        x = F.rms_norm(residual, (D,), self.post_norm, EPS)
        x = x if group is None else _CopyToTP.apply(x, group)
        g, u = F.linear(x, self.gate_up).chunk(2, -1)
        h = F.linear(F.silu(g) * u, self.down)
        return (h if group is None else _ReduceFromTP.apply(h, group)), residual


class DecoderStack(torch.nn.Module):
    def __init__(self, layers: int, tp: int, rank: int, device: str):
        super().__init__()
        self.layers = torch.nn.ModuleList(DecoderLayer(tp, device) for _ in range(layers))
        self.norm = torch.nn.Parameter(torch.ones(D, device=device, dtype=torch.bfloat16))
        self.vocab_local = VOCAB // tp
        self.vocab_start = rank * self.vocab_local
        self.lm_head = torch.nn.Parameter((torch.randn(self.vocab_local, D, device=device) * 0.02).to(torch.bfloat16))

    def hidden(self, x, batch, strict: bool, group):
        h, residual = x, None
        for layer in self.layers:
            h, residual = layer(h, residual, batch, strict, group)
        if strict:
            return rk.rms_norm(h, self.norm, EPS, residual=residual)[0]
        return F.rms_norm(h + residual, (D,), self.norm, EPS)

    def logprobs(self, h, targets, strict: bool, group):
        if strict:
            return rk.logprobs(h, self.lm_head, targets, 1.0, vocab_size=VOCAB, group=group)
        h = h if group is None else _CopyToTP.apply(h, group)
        logits = F.linear(h, self.lm_head).float()
        if group is None:
            return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        return _VocabParallelLogprob.apply(logits, targets, self.vocab_start, group)


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure(model, opt, x, batch, targets, strict: bool, group) -> dict[str, float]:
    """One repetition of every phase (ms)."""
    out: dict[str, float] = {}
    with torch.no_grad():
        out["scoring_forward"] = timed(
            lambda: model.logprobs(model.hidden(x, batch, strict, group), targets, strict, group)
        )
    opt.zero_grad(set_to_none=True)
    state = {}

    def fwd():
        state["lp"] = model.logprobs(model.hidden(x, batch, strict, group), targets, strict, group)
        state["loss"] = -(state["lp"] * batch["adv"]).mean()

    out["forward"] = timed(fwd)
    out["backward"] = timed(lambda: state["loss"].backward())
    out["optimizer"] = timed(opt.step)
    h = batch["h_lm"]
    with torch.no_grad():
        out["logprob_forward"] = timed(lambda: model.logprobs(h, targets, strict, group))
    hl = h.detach().requires_grad_()
    out["logprob_forward_backward"] = timed(lambda: model.logprobs(hl, targets, strict, group).sum().backward())
    out["step"] = out["forward"] + out["backward"] + out["optimizer"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="print the top GPU kernels of one strict training forward")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    group = None
    if world > 1:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        group = dist.group.WORLD
    rk.set_canonical_tp(world)
    rk.set_backend("triton")
    dev = "cuda"
    torch.manual_seed(0)  # the same weights and batch on every rank (shards differ by construction)
    model = DecoderStack(a.layers, world, rank, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    t = a.seqs * a.seq_len
    pos = torch.arange(a.seq_len, device=dev).repeat(a.seqs)
    inv = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, device=dev, dtype=torch.float32) / HEAD_DIM))
    ang = pos[:, None].float() * inv[None]
    batch = {
        "pos": pos,
        "cu": torch.arange(0, t + 1, a.seq_len, device=dev, dtype=torch.int32),
        "seqs": a.seqs,
        "max_len": a.seq_len,
        "cos": ang.cos(),
        "sin": ang.sin(),
        "adv": torch.randn(t, device=dev),
        "h_lm": torch.randn(t, D, device=dev).to(torch.bfloat16),
    }
    x = torch.randn(t, D, device=dev).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (t,), device=dev)
    state_before = gpu_state()
    samples: dict[str, list[list[dict]]] = {"strict": [[], []], "native": [[], []]}
    peak: dict[str, float] = {}
    t0 = time.time()
    for name in ("native", "strict"):  # warm-up (compiles, autotunes, allocates)
        torch.cuda.reset_peak_memory_stats()
        for _ in range(a.warmup):
            measure(model, opt, x, batch, targets, name == "strict", group)
        peak[name] = torch.cuda.max_memory_allocated() / 1e9
    for rep in range(2 * a.reps):
        for name in ("native", "strict") if rep % 2 == 0 else ("strict", "native"):
            samples[name][rep // a.reps].append(measure(model, opt, x, batch, targets, name == "strict", group))
    state_after = gpu_state()
    phases = list(samples["strict"][0][0])
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tp": world,
        "layers": a.layers,
        "tokens": t,
        "seqs": a.seqs,
        "seq_len": a.seq_len,
        "reps_per_pass": a.reps,
        "passes": 2,
        "gpu_before": state_before,
        "gpu_after": state_after,
        "wall_s": round(time.time() - t0, 1),
        "cublaslt_ready": rk.backends.triton.cublaslt_ready(),
        "peak_gb": peak,
        "phases": {},
    }
    for ph in phases:
        row = {}
        for name in ("native", "strict"):
            med = [statistics.median(s[ph] for s in samples[name][i]) for i in range(2)]
            row[f"{name}_ms"] = round(statistics.median([s[ph] for ps in samples[name] for s in ps]), 3)
            row[f"{name}_pass_ms"] = [round(m, 3) for m in med]
            row[f"{name}_pass_spread"] = round(abs(med[0] - med[1]) / min(med), 4)
        row["strict_over_native"] = round(row["strict_ms"] / row["native_ms"], 3)
        result["phases"][ph] = row
    step = result["phases"]["step"]
    result["tokens_per_s"] = {n: round(t / (step[f"{n}_ms"] / 1e3)) for n in ("native", "strict")}
    if rank == 0:
        print(f"TRAIN_STEP {result['device']} TP{world} layers={a.layers} tokens={t}  before: {state_before}")
        print(f"{'phase':26s} {'native ms':>10s} {'strict ms':>10s} {'strict/native':>14s}  pass spread n/s")
        for ph, r in result["phases"].items():
            print(
                f"{ph:26s} {r['native_ms']:10.2f} {r['strict_ms']:10.2f} {r['strict_over_native']:14.3f}  "
                f"{r['native_pass_spread']:.3f}/{r['strict_pass_spread']:.3f}"
            )
        print(
            f"tokens/s native {result['tokens_per_s']['native']}  strict {result['tokens_per_s']['strict']}; "
            f"peak GB native {peak['native']:.1f} strict {peak['strict']:.1f}; after: {state_after}"
        )
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=1))
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.logprobs(model.hidden(x, batch, True, group), targets, True, group).sum().backward()
            torch.cuda.synchronize()
        if rank == 0:
            for key in ("cuda_time_total", "self_cpu_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=16, max_name_column_width=60))
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
