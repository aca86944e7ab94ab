"""Multi-process workers for the Megatron tests: each spawned rank joins a gloo world, runs the
requested (tp, cp) configurations one after the other and rank 0 saves what it saw to a file that
the test process then checks."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_kernel.selftest.ranks import free_port

LENGTHS = (150, 70, 5, 33, 96, 130)  # several key chunks of 64, a split boundary, short ones
PROMPTS = (20, 3, 2, 10, 64, 1)
TEMPERATURE = 0.7
LR = 1e-3


LONG_LENGTHS = (1300, 600, 70, 513)  # several 512-key splits: Triton CP deals whole splits to ranks
LONG_PROMPTS = (100, 7, 3, 500)


def samples(vocab: int = 512, long: bool = False) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths, prompts = (LONG_LENGTHS, LONG_PROMPTS) if long else (LENGTHS, PROMPTS)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths], list(prompts)


def train_inputs(old: list[torch.Tensor]) -> dict:
    """Advantages and a reference policy for one GRPO-style step (deterministic)."""
    g = torch.Generator().manual_seed(7)
    adv = (torch.randn(len(old), generator=g)).tolist()
    ref = [o - 0.05 * torch.rand(o.shape, generator=g) for o in old]
    return {"advantages": adv, "ref_logprobs": ref}


def spawn(world: int, jobs: list[dict], ckpt: Path, out: Path, device: str = "cpu", canonical_tp: int = 2) -> dict:
    """Run `jobs` on a fresh world of `world` processes (gloo on CPU, NCCL on CUDA, one GPU per
    rank); returns rank 0's results. `canonical_tp`: the widest TP of the "deployment" the tests compare
    across spawns (TP1 against TP2), the same in every spawn (the Triton GEMM contract's K groups)."""
    mp.spawn(_run, args=(world, jobs, str(ckpt), str(out), free_port(), device, canonical_tp), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def _run(
    rank: int, world: int, jobs: list[dict], ckpt: str, out: str, port: int, device: str, canonical_tp: int
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from megatron.core import parallel_state

    import rl_kernel as rk

    rk.set_canonical_tp(canonical_tp)

    results = {}
    try:
        for job in jobs:
            key = f"tp{job['tp']}cp{job['cp']}"
            parallel_state.initialize_model_parallel(job["tp"], 1, context_parallel_size=job["cp"])
            try:
                results[key] = _job(job, ckpt, device)
            finally:
                parallel_state.destroy_model_parallel()
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _job(job: dict, ckpt: str, device: str) -> dict:
    from megatron.core import parallel_state

    from rl_kernel import evidence
    from rl_kernel.integrations.megatron import MegatronPolicy
    from rl_kernel.models.qwen3 import Qwen3Reference
    from rl_kernel.ops.truncation import Truncation
    from vime.trainer.grpo import LossConfig, TrainBatch, score, train_step

    tp, cp = job["tp"], job["cp"]
    seqs, prompts = samples(long=job.get("long", False))
    res: dict = {}
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    ref = Qwen3Reference.from_pretrained(ckpt, group=tp_group, device=device)
    res["ref"] = ref.sequence_logprobs(seqs, prompts, TEMPERATURE)
    if tp > 1:
        ref1 = Qwen3Reference.from_pretrained(ckpt, device=device)
        res["ref_tp1"] = ref1.sequence_logprobs(seqs, prompts, TEMPERATURE)
    for mode in job.get("modes", ("strict",)):
        policy = MegatronPolicy(ckpt, tp=tp, cp=cp, mode=mode, lr=LR, device=device)
        evidence.reset()
        res[f"{mode}"] = score(policy, seqs, prompts, TEMPERATURE)
        res[f"{mode}_evidence"] = sorted({(r["op"], r["mode"]) for r in evidence.snapshot()})
        if job.get("routes"):  # each MoE layer's expert ids of every token, the trainer's and the reference's
            from rl_kernel.models.qwen3_moe import capture_routes

            with capture_routes(policy.model) as routes:
                score(policy, seqs, prompts, TEMPERATURE)
            with capture_routes(ref.model) as ref_routes:
                ref.sequence_logprobs(seqs, prompts, TEMPERATURE)
            res[f"{mode}_routes"] = [torch.cat(r) for r in routes]
            res["ref_routes"] = [torch.cat(r) for r in ref_routes]
        if job.get("packings"):
            res[f"{mode}_mb1"] = score(policy, seqs, prompts, TEMPERATURE, micro_batch_size=1)
            order = list(reversed(range(len(seqs))))
            rev = score(policy, [seqs[i] for i in order], [prompts[i] for i in order], TEMPERATURE, micro_batch_size=4)
            res[f"{mode}_mb4_reversed"] = [rev[order.index(i)] for i in range(len(seqs))]
        if job.get("export") and mode == "strict":
            res["export"] = policy.export_hf_state_dict()
        if job.get("train"):  # exact top-p scoring (strict), and the native training step's entropy
            truncation = Truncation(top_k=200, top_p=0.99)
            if mode == "strict":
                policy.truncation = truncation
                res["strict_truncated"] = score(policy, seqs, prompts, TEMPERATURE)
                policy.truncation = None
                res["ref_truncated"] = ref.sequence_logprobs(seqs, prompts, TEMPERATURE, truncation)
            else:
                batch = TrainBatch(seqs, prompts, train_inputs(res["ref"])["advantages"], res["ref"], None, TEMPERATURE)
                res["native_train_metrics"] = train_step(policy, batch, LossConfig(entropy_coef=0.01))
        if job.get("train") and mode == "strict":
            extra = train_inputs(res["ref"])
            batch = TrainBatch(seqs, prompts, extra["advantages"], res["ref"], extra["ref_logprobs"], TEMPERATURE)
            res["train_metrics"] = train_step(policy, batch, LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1))
            res["train_main_grad"] = policy.export_hf_state_dict("main_grad")
            res["train_main"] = policy.export_hf_state_dict("main")
            res["train_model"] = policy.export_hf_state_dict("model")
        del policy
    if job.get("gspo"):  # a GSPO step whose sequence ratios are not 1: their means span the CP ranks' tokens
        policy = MegatronPolicy(ckpt, tp=tp, cp=cp, mode="strict", lr=LR, device=device)
        g = torch.Generator().manual_seed(11)
        old = [o - torch.rand(o.shape, generator=g) for o in res["ref"]]
        batch = TrainBatch(seqs, prompts, train_inputs(res["ref"])["advantages"], old, None, TEMPERATURE)
        wide = LossConfig(policy_loss="gspo", loss_agg="seq_mean_token_mean", gspo_clip_low=0.99, gspo_clip_high=9.0)
        res["gspo_metrics"] = train_step(policy, batch, wide)
        res["gspo_main_grad"] = policy.export_hf_state_dict("main_grad")
        del policy
    return res
