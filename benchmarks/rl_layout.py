"""RL loop in the reference system's layout: Megatron-core TP x CP trainer against rl_kernel's reference
rollout path (paged KV, continuous batching) at TP, on the same random bf16 weights, strict vs native.

    torchrun --nproc_per_node 2 benchmarks/rl_layout.py --tp 2 --cp 1                  # 2 GPUs, Qwen3-8B shapes
    torchrun --nproc_per_node 8 benchmarks/rl_layout.py --tp 4 --cp 2                  # the issue-6 layout
    torchrun --nproc_per_node 2 benchmarks/rl_layout.py --tp 2 --cp 1 --device cpu --preset tiny   # gloo smoke

World = tp * cp ranks. The trainer is one Megatron TP x CP group (`MegatronPolicy`); the rollout is
`cp` engines (`RolloutEngine` over `Qwen3Reference`), each on one Megatron TP group, a GRPO group of
samples staying on one engine. Per mode (strict: rl_kernel everywhere; native: Megatron's own modules
against the reference in `rk.mode("native")`) and per step: generate, recompute the response logprobs
by teacher forcing in Megatron and compare fp32 bit patterns on every response token, one GRPO train
step (reward: share of even token ids; group-normalised advantages), then push the updated weights
(Megatron -> HF names -> `Qwen3Reference.load_hf_weights`) before the next step. Rank 0 writes the
JSON after every step (a killed run keeps what it finished) and prints a table. Exit status 1 when
strict shows a mismatch or native shows none.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rl_kernel as rk  # noqa: E402
from rl_kernel.bits import bit_mismatches  # noqa: E402
from rl_kernel.integrations.megatron import MegatronPolicy  # noqa: E402
from rl_kernel.models.qwen3 import Qwen3Reference  # noqa: E402
from rl_kernel.models.rollout import Request, RolloutEngine  # noqa: E402
from vime.consistency import compare  # noqa: E402
from vime.trainer.grpo import LossConfig, TrainBatch, score, train_step  # noqa: E402

# Model shapes (HF Qwen3 config fields) and batch defaults per preset. "8b": Qwen3-8B layers (few of them).
PRESETS = {
    "8b": dict(shape=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_heads=32,
                          num_kv_heads=8, head_dim=128, num_layers=2, init_std=0.02),
               prompts=4, group=2, prompt_len=(64, 256), new_tokens=64, steps=3, lr=1e-4,
               block_size=16, max_batched_tokens=512),
    "tiny": dict(shape=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4,
                            num_kv_heads=2, head_dim=32, num_layers=2, init_std=0.1),
                 prompts=2, group=2, prompt_len=(20, 100), new_tokens=12, steps=3, lr=1e-3,
                 block_size=16, max_batched_tokens=48),
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, required=True, help="tensor parallel size (trainer and each rollout engine)")
    p.add_argument("--cp", type=int, default=1, help="trainer context parallel size (= number of rollout engines)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto", help="rl_kernel strict backend")
    p.add_argument("--modes", default="strict,native", help="comma list of strict / native")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/rl_layout_tp<tp>_cp<cp>.json when $OUT "
                   "is set, else benchmarks/results/; name rl_layout_tp<tp>_cp<cp>_<device>_<preset>.json)")
    p.add_argument("--ckpt-dir", default=tempfile.gettempdir(), help="where the random checkpoint is written once")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    for name in ("prompts", "group", "new_tokens", "steps", "max_batched_tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help="override the preset")
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="override the preset")
    p.add_argument("--lr", type=float, help="override the preset (large enough to change bf16 weights)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    for key, value in preset.items():
        if key != "shape" and getattr(args, key, None) is None:
            setattr(args, key, value)
    args.shape = dict(preset["shape"], **({"num_layers": args.layers} if args.layers else {}))
    modes = args.modes.split(",")
    if not modes or any(m not in ("strict", "native") for m in modes):
        p.error(f"--modes must list strict and/or native, got {args.modes!r}")
    args.modes = modes
    if min(args.tp, args.cp, args.prompts, args.group, args.new_tokens, args.steps, args.prompt_len[0]) < 1 \
            or args.prompt_len[0] > args.prompt_len[1]:
        p.error("tp, cp, prompts, group, new tokens, steps must be >= 1 and 1 <= prompt-len MIN <= MAX")
    if args.out is None:
        name = f"rl_layout_tp{args.tp}_cp{args.cp}_{args.device}_{args.preset}.json"
        args.out = str(Path(os.environ["OUT"]) / name if os.environ.get("OUT") else
                       Path(__file__).parent / "results" / name)
    return args


# ---- setup ---------------------------------------------------------------------------------------

def _init_dist(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node <tp*cp> benchmarks/rl_layout.py --tp N --cp M")
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if world != args.tp * args.cp:
        raise SystemExit(f"world size {world} != tp * cp = {args.tp * args.cp}: start tp*cp processes")
    if args.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
            raise SystemExit(f"--device cuda but local rank {local} sees {torch.cuda.device_count()} GPUs "
                             "(use --device cpu on a CPU machine)")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    # torchrun pins OMP_NUM_THREADS=1; the CPU-side work (weight export, checkpoint I/O) wants a share of the cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), world, device


def _checkpoint(args: argparse.Namespace, device: torch.device) -> Path:
    """Random bf16 Qwen3 checkpoint (HF config.json + model.safetensors), written by rank 0 once per shape
    and seed, reused by later runs. Linear weights and embeddings ~ N(0, init_std), norms ~ U(0.5, 1.5)."""
    s = args.shape
    key = hashlib.sha256(json.dumps([s, args.seed], sort_keys=True).encode()).hexdigest()[:12]
    path = Path(args.ckpt_dir) / f"rl_layout_qwen3_{args.preset}_{key}"
    if dist.get_rank() == 0 and not (path / "model.safetensors").is_file():
        from safetensors.torch import save_file
        from transformers import Qwen3Config

        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        Qwen3Config(
            vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
            num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
            num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"], max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
            tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"], dtype="bfloat16",
        ).save_pretrained(tmp)
        g = torch.Generator(device=device).manual_seed(args.seed)
        D, d, H, Hkv, inter = s["hidden_size"], s["head_dim"], s["num_heads"], s["num_kv_heads"], s["intermediate_size"]

        def randn(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=g, device=device) * s["init_std"]).to(torch.bfloat16).cpu()

        def norm(n: int) -> torch.Tensor:
            return (torch.rand(n, generator=g, device=device) + 0.5).to(torch.bfloat16).cpu()

        w = {"model.embed_tokens.weight": randn(s["vocab_size"], D), "model.norm.weight": norm(D),
             "lm_head.weight": randn(s["vocab_size"], D)}
        for i in range(s["num_layers"]):
            p = f"model.layers.{i}."
            w |= {p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
                  p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
                  p + "self_attn.q_proj.weight": randn(H * d, D), p + "self_attn.k_proj.weight": randn(Hkv * d, D),
                  p + "self_attn.v_proj.weight": randn(Hkv * d, D), p + "self_attn.o_proj.weight": randn(D, H * d),
                  p + "mlp.gate_proj.weight": randn(inter, D), p + "mlp.up_proj.weight": randn(inter, D),
                  p + "mlp.down_proj.weight": randn(D, inter)}
        save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if not path.exists():
            tmp.rename(path)
    dist.barrier()
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}: checkpoint missing after rank 0 wrote it (--ckpt-dir must be shared by "
                                "all ranks)")
    return path


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod, name in (("megatron.core", "megatron-core"), ("triton", "triton"), ("transformers", "transformers")):
        try:
            v[name] = __import__(mod, fromlist=["__version__"]).__version__
        except ImportError:
            v[name] = None
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return v


# ---- one RL step -------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _timed(device: torch.device, fn, *a, **kw):
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    _sync(device)
    return out, time.perf_counter() - t0


def _prompts(args: argparse.Namespace, step: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed * 7919 + step)
    lens = torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (args.prompts,), generator=g).tolist()
    return [torch.randint(0, args.shape["vocab_size"], (n,), generator=g).tolist() for n in lens]


def _rollout(engine: RolloutEngine, prompts: list[list[int]], args: argparse.Namespace, mode: str, step: int,
             engine_id: int, tp_rank: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every sample of every prompt (prompt-major, `group` samples each): response tokens and their fp32
    rollout logprobs. GRPO group g runs on engine g % cp; the completions are all-gathered to every rank."""
    mine = [g for g in range(len(prompts)) if g % args.cp == engine_id]
    reqs = [Request(prompts[g], args.new_tokens, args.temperature) for g in mine for _ in range(args.group)]
    with rk.mode(mode), torch.no_grad():
        done = engine.generate(reqs, seed=args.seed * 1_000_003 + step * args.cp + engine_id) if reqs else []
    keys = [g * args.group + j for g in mine for j in range(args.group)]
    payload = [(k, c.token_ids, c.logprobs.cpu()) for k, c in zip(keys, done)] if tp_rank == 0 else []
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, payload)
    by_key = {k: (t, lp) for part in parts for k, t, lp in part}
    ordered = [by_key[k] for k in range(len(prompts) * args.group)]
    return [t for t, _ in ordered], [lp for _, lp in ordered]


def _compare(rollout: list[torch.Tensor], trainer: list[torch.Tensor]) -> dict:
    """Agreement on every response token (vime's metric: fp32 bit patterns, fp64 |diff|)."""
    c = compare([x.float().cpu() for x in rollout], [x.float().cpu() for x in trainer])
    return {"tokens": c.tokens, "mismatch_count": c.mismatch_count, "max_abs_diff": c.max_abs_diff,
            "mean_abs_diff": c.mean_abs_diff}


def _advantages(responses: list[list[int]], group: int) -> tuple[list[float], float]:
    """Reward = share of even token ids in the response; advantages normalised within each GRPO group."""
    r = torch.tensor([sum(t % 2 == 0 for t in resp) / max(len(resp), 1) for resp in responses]).view(-1, group)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + 1e-6)
    return adv.flatten().tolist(), float(r.mean())


def _evidence(records: list[dict]) -> list[str]:
    return sorted({f"{r['op']}:{r['mode']}:{r['backend']}:{r['fingerprint']}" for r in records})


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _weights_changed(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> int:
    return bit_mismatches([new[k] for k in new], [old[k] for k in new])


def _run_mode(mode: str, args: argparse.Namespace, ckpt: Path, device: torch.device, out: dict, on_step) -> None:
    """Fresh trainer and rollout from the checkpoint, then `args.steps` RL steps; fills `out` in place
    (`out["steps"]` grows by one row per step, then `on_step(row)` runs)."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group() if args.tp > 1 else None
    engine_id, tp_rank = parallel_state.get_context_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    (policy, ref), out["setup_s"] = _timed(device, lambda: (
        MegatronPolicy(ckpt, tp=args.tp, cp=args.cp, mode=mode, lr=args.lr, clip_grad=1.0, device=device),
        Qwen3Reference.from_pretrained(ckpt, group=tp_group, device=device)))
    per_engine = -(-args.prompts // args.cp) * args.group
    blocks = per_engine * -(-(args.prompt_len[1] + args.new_tokens) // args.block_size)
    engine = RolloutEngine(ref, num_blocks=blocks, block_size=args.block_size,
                           max_num_batched_tokens=args.max_batched_tokens, block_seed=args.seed)
    previous = _load_safetensors(ckpt) if dist.get_rank() == 0 else None
    for step in range(args.steps):
        prompts = _prompts(args, step)
        with rk.evidence.recording() as rollout_ops:
            (responses, old), rollout_s = _timed(device, _rollout, engine, prompts, args, mode, step, engine_id,
                                                 tp_rank)
        seqs = [prompts[i // args.group] + r for i, r in enumerate(responses)]
        prompt_lens = [len(prompts[i // args.group]) for i in range(len(seqs))]
        with rk.evidence.recording() as trainer_ops:
            lps, logprobs_s = _timed(device, score, policy, seqs, prompt_lens, args.temperature)
        row = {"step": step, "weight_version": step, **_compare(old, lps)}
        advantages, reward = _advantages(responses, args.group)
        metrics, train_s = _timed(device, train_step, policy,
                                  TrainBatch(seqs, prompt_lens, advantages, old, temperature=args.temperature),
                                  LossConfig(clip_low=0.2, clip_high=0.28))
        hf, export_s = _timed(device, policy.export_hf_state_dict)
        _, load_s = _timed(device, ref.load_hf_weights, hf)
        if dist.get_rank() == 0:  # bf16 elements this step's update changed (so the push is not vacuous)
            row["weights_changed"] = _weights_changed(hf, previous)
            previous = hf
        row |= {"train_mismatch_count": int(metrics["mismatch_count"]), "train_max_abs_diff": metrics["max_abs_diff"],
                "ratio_mean": metrics["ratio_mean"], "clip_frac": metrics["clip_frac"], "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"], "reward_mean": reward, "prompt_tokens": sum(prompt_lens),
                "rollout_s": rollout_s, "logprobs_s": logprobs_s, "train_s": train_s, "sync_s": export_s + load_s,
                "rollout_tokens_per_s": sum(len(r) for r in responses) / rollout_s,
                "engine_forward_steps": len(engine.trace)}  # this rank's engine: chunked prefill + decode steps
        if step == 0:
            out["rollout_ops"], out["trainer_ops"] = _evidence(rollout_ops), _evidence(trainer_ops)
        out["steps"].append(row)
        on_step(mode, row)
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    steady = out["steps"][1:] or out["steps"]  # step 0 includes kernel compilation and warm-up
    out["median_s"] = {k: statistics.median(r[k] for r in steady)
                       for k in ("rollout_s", "logprobs_s", "train_s", "sync_s")}
    del policy, ref, engine, previous
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- report ----------------------------------------------------------------------------------------

def _summary(modes: dict) -> dict:
    s: dict = {}
    if "strict" in modes:
        st = modes["strict"]["steps"]
        s["strict_ok"] = bool(st) and all(r["mismatch_count"] == 0 and r["max_abs_diff"] == 0.0
                                          and r["train_mismatch_count"] == 0 for r in st)
        ops = [op for side in ("rollout_ops", "trainer_ops") for op in modes["strict"].get(side, [])]
        fingerprints = {}
        for op in ops:  # "op:mode:backend:fingerprint"
            name, _, _, fp = op.split(":")
            fingerprints.setdefault(name, set()).add(fp)
        s["strict_contracts_match"] = all(op.split(":")[1] == "strict" for op in ops) and \
            all(len(fps) == 1 for fps in fingerprints.values())
    if "native" in modes:
        s["native_mismatch_every_step"] = all(r["mismatch_count"] > 0 for r in modes["native"]["steps"])
    if all("median_s" in modes.get(m, {}) for m in ("strict", "native")):
        a, b = modes["strict"]["median_s"], modes["native"]["median_s"]
        s["strict_over_native"] = {k: a[k] / b[k] for k in a if b[k] > 0}
    return s


def _table(result: dict) -> str:
    cols = ("step", "tokens", "mismatch_count", "max_abs_diff", "train_mismatch_count", "ratio_mean",
            "weights_changed", "rollout_s", "logprobs_s", "train_s", "sync_s")
    head = ["mode", "step", "tokens", "mismatch", "max_abs_diff", "train_mism", "ratio_mean", "w_changed",
            "rollout_s", "logprob_s", "train_s", "sync_s"]
    lines = [" ".join(f"{h:>12}" for h in head)]
    for mode, res in result["modes"].items():
        for r in res["steps"]:
            cells = [mode] + [r.get(c) for c in cols]
            lines.append(" ".join(f"{c:>12.4g}" if isinstance(c, float) else f"{'-' if c is None else c!s:>12}"
                                  for c in cells))
    return "\n".join(lines)


def main() -> int:
    args = _args()
    rank, world, device = _init_dist(args)
    rk.set_backend(args.backend)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(args.tp, 1, context_parallel_size=args.cp)
    t_start = time.perf_counter()
    ckpt, ckpt_s = _timed(device, _checkpoint, args, device)
    s = args.shape
    per_layer = s["hidden_size"] * ((s["num_heads"] + s["num_kv_heads"]) * s["head_dim"] * 2
                                    + 3 * s["intermediate_size"])
    params = s["num_layers"] * per_layer + 2 * s["vocab_size"] * s["hidden_size"]
    result = {
        "script": "benchmarks/rl_layout.py", "issue": 6, "complete": False,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"),
        "device_type": device.type, "world_size": world, "tp": args.tp, "cp": args.cp, "rollout_engines": args.cp,
        "rollout_tp": args.tp, "backend": args.backend, "preset": args.preset, "versions": _versions(),
        "shapes": dict(s, params=params, dtype="bfloat16"),
        "batch": {"prompts": args.prompts, "samples_per_prompt": args.group, "sequences": args.prompts * args.group,
                  "prompt_len": list(args.prompt_len), "new_tokens": args.new_tokens, "temperature": args.temperature,
                  "steps": args.steps, "lr": args.lr, "block_size": args.block_size,
                  "max_num_batched_tokens": args.max_batched_tokens},
        "checkpoint_s": ckpt_s, "modes": {},
    }

    def write() -> None:
        if rank == 0:
            result["wall_s"] = time.perf_counter() - t_start
            result["summary"] = _summary({m: r for m, r in result["modes"].items() if r["steps"]})
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))

    def on_step(mode: str, row: dict) -> None:
        if rank == 0:
            print(f"[rl_layout] {mode} step {row['step']}: {row['mismatch_count']}/{row['tokens']} mismatched, "
                  f"max_abs_diff {row['max_abs_diff']:.3g}, rollout {row['rollout_s']:.2f}s, "
                  f"train {row['train_s']:.2f}s", flush=True)
        write()

    if rank == 0:
        print(f"[rl_layout] world {world} = tp {args.tp} x cp {args.cp} on {result['device']}, preset {args.preset} "
              f"({params / 1e9:.2f}B params), checkpoint {ckpt} ({ckpt_s:.1f}s)", flush=True)
    for mode in args.modes:
        _run_mode(mode, args, ckpt, device, result["modes"].setdefault(mode, {"steps": []}), on_step)
        write()
    result["complete"] = True
    write()
    code = 0
    if rank == 0:
        summary = result["summary"]
        print(_table(result))
        print(json.dumps({"summary": summary, "out": args.out}, indent=1))
        print("RL_LAYOUT_JSON " + json.dumps(result))  # the whole result in the log too, in case $OUT is not fetched
        failures = []
        if summary.get("strict_ok") is False:
            failures.append("strict mode shows trainer/rollout mismatches")
        if summary.get("strict_contracts_match") is False:
            failures.append("strict evidence shows a native op or differing contract fingerprints between sides")
        if summary.get("native_mismatch_every_step") is False:
            failures.append("native mode shows no mismatch on some step")
        print(f"RESULT rl_layout tp{args.tp} cp{args.cp}: " + ("; ".join(failures) if failures else
              "strict 0 mismatches / max_abs_diff 0 on every step" +
              (", native mismatches on every step" if "native" in result["modes"] else "")), flush=True)
        code = 1 if failures else 0
    codes = [code]
    dist.broadcast_object_list(codes, src=0)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return codes[0]


if __name__ == "__main__":
    sys.exit(main())
