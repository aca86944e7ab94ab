"""Spawned gloo ranks for the expert-parallel RKMoELayer test: each rank initialises Megatron's parallel state with
expert_model_parallel_size = world, builds `RKMoELayer` (its expert slice), loads the case's weights (the whole
router, its experts), runs its tokens forward (strict, then native) and backward, and saves what it saw; then it
checks that `MegatronPolicy` refuses that parallel state."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_kernel.selftest.ranks import free_port


def spawn_ep(world: int, case: dict, ckpt: Path, out: Path) -> list[dict]:
    """Run the case on `world` ranks; returns each rank's results, rank order."""
    torch.save(case, f"{out}.case")
    mp.spawn(_run, args=(world, str(out), str(ckpt), free_port()), nprocs=world, join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(world)]


def _run(rank: int, world: int, out: str, ckpt: str, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    case = torch.load(f"{out}.case", weights_only=False)
    try:
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
        try:
            result = _layer(case, rank, world, parallel_state.get_expert_model_parallel_rank())
        finally:
            parallel_state.destroy_model_parallel()
        # the policy refuses EP > 1 (tp 1 x cp world, so its tp / cp check passes and the EP one speaks)
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world, expert_model_parallel_size=world)
        try:
            from rl_kernel.integrations.megatron.policy import MegatronPolicy

            MegatronPolicy(ckpt, tp=1, cp=world, device="cpu")
            result["policy_error"] = None
        except ValueError as e:
            result["policy_error"] = str(e)
        finally:
            parallel_state.destroy_model_parallel()
        torch.save(result, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _layer(case: dict, rank: int, world: int, ep_rank: int) -> dict:
    from megatron.core.transformer.transformer_config import TransformerConfig

    import rl_kernel as rk
    from rl_kernel.integrations.megatron.spec import RKMoELayer

    router, gate_up, down = case["router"], case["gate_up"], case["down"]
    experts, dim = router.shape
    shape = SimpleNamespace(
        hidden_size=dim,
        num_experts=experts,
        num_experts_per_tok=case["top_k"],
        norm_topk_prob=True,
        moe_intermediate_size=down.shape[-1],
    )
    config = TransformerConfig(
        num_layers=1, hidden_size=dim, num_attention_heads=1, use_cpu_initialization=True, params_dtype=router.dtype
    )
    layer = RKMoELayer(config, shape)
    local = experts // world
    with torch.no_grad():
        layer.gate.weight.copy_(router)
        layer.experts.gate_up_proj.copy_(gate_up[ep_rank * local : (ep_rank + 1) * local])
        layer.experts.down_proj.copy_(down[ep_rank * local : (ep_rank + 1) * local])
    rows = slice(sum(case["tokens"][:rank]), sum(case["tokens"][: rank + 1]))
    hidden = case["x"][rows].unsqueeze(1)  # [s, b=1, h], Megatron's layout
    layer.routes = []
    with rk.mode("strict"):
        out, _ = layer(hidden)
        (out.to(torch.float32) * case["grad_out"][rows].unsqueeze(1)).sum().backward()
    with rk.mode("native"):
        native, _ = layer(hidden)
    return {
        "ep": layer.ep,
        "ep_rank": ep_rank,
        "out": out.detach().squeeze(1),
        "ids": layer.routes[0],
        "native": native.detach().squeeze(1),
        "expert_shapes": [tuple(p.shape) for p in layer.experts.parameters()],
        "allreduce": [getattr(p, "allreduce", True) for p in layer.experts.parameters()],
        "grad_gate_up": layer.experts.gate_up_proj.grad,
        "grad_router": layer.gate.weight.grad,
    }
