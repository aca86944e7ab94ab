"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`) in rl_kernel's reference model.

The model is the dense reference with its sparse layers' MLP replaced by `rl_kernel.models.layers.SparseMoeBlock`
(the strict MoE ops: `rk.moe_route`, `rk.moe_experts`, `rk.moe_combine`); `Qwen3Reference`, the paged
`RolloutEngine`, teacher forcing and HF weight loading all take a `Qwen3MoeConfig` as they take a dense
`Qwen3Config` (`rl_kernel.models.qwen3.read_config` returns one for a Qwen3MoeForCausalLM checkpoint). Weights
are in the HF hub layout (`model.layers.{i}.mlp.gate.weight`, `model.layers.{i}.mlp.experts.{j}.
{gate,up,down}_proj.weight`; see `rl_kernel.models.qwen3_layout`). Tensor parallelism 1 only (expert
parallelism 1): a tp > 1 model raises.

`capture_routes(model)` records each MoE layer's expert ids per forward: what the routing agreement between
rollout and trainer is measured on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from rl_kernel.models.qwen3 import Qwen3Config
from rl_kernel.ops.moe import check_top_k

# HF Qwen3-MoE keys this model reads (beyond the dense Qwen3's); their meaning is transformers' Qwen3MoeConfig's.
MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",
)
# Options of other MoE families (Qwen2-MoE's shared expert, DeepSeek's grouped routing and biased router) that
# the strict model does not implement: a config that sets one is refused.
UNSUPPORTED_KEYS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "topk_method",
    "scoring_func",
)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> Qwen3MoeConfig:
        """Validate an HF Qwen3-MoE config dict; a one-line ValueError naming the key for what the strict
        model does not cover (another architecture, another MoE family's options, top-k > num_experts)."""
        archs = cfg.get("architectures") or []
        if "Qwen3MoeForCausalLM" not in archs or cfg.get("model_type") not in (None, "qwen3_moe"):
            raise ValueError(
                f"{source}: architecture {archs} / model_type {cfg.get('model_type')!r} is not a "
                "Qwen3MoeForCausalLM; rl_kernel's MoE model implements only that"
            )
        unsupported = [k for k in UNSUPPORTED_KEYS if cfg.get(k)]
        if unsupported:
            raise ValueError(f"{source}: MoE options {unsupported} are not implemented by the strict Qwen3-MoE model")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not experts or not cfg.get("moe_intermediate_size"):
            raise ValueError(f"{source}: a Qwen3-MoE config needs num_experts and moe_intermediate_size > 0")
        try:
            check_top_k(int(cfg.get("num_experts_per_tok", 0)), int(experts))
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"{source}: decoder_sparse_step={step} must be >= 1")
        dense = {k: v for k, v in cfg.items() if k not in MOE_KEYS}
        base = Qwen3Config.from_hf(dense | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, source)
        return cls(
            **dataclasses.asdict(base),
            num_experts=int(experts),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=step,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's `SparseMoeBlock`s in layer order (a `Qwen3Reference`'s `.model` or any module holding them)."""
    from rl_kernel.models.layers import SparseMoeBlock

    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@contextlib.contextmanager
def capture_routes(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Within the block, every MoE layer's forward appends its expert ids [T, k] to the layer's list (the
    yielded list holds one list per MoE layer, in layer order)."""
    blocks = moe_blocks(model)
    captured: list[list[torch.Tensor]] = [[] for _ in blocks]
    for block, routes in zip(blocks, captured):
        block.routes = routes
    try:
        yield captured
    finally:
        for block in blocks:
            block.routes = None


def rollout_routes(trace: list[list[tuple[int, int, int]]], captured: list[list[torch.Tensor]], lengths: list[int]):
    """Per request, int16 [lengths[i], MoE layers, k]: the expert ids `RolloutEngine` routed each fed position to,
    from its `trace` (per step: (request, first position, tokens)) and the routes `capture_routes` recorded over
    the same `generate` (one tensor per step and layer, rows in the step's request order); -1 where not fed."""
    if not captured or not captured[0]:
        return [None] * len(lengths)
    k = captured[0][0].shape[-1]
    out = [torch.full((n, len(captured), k), -1, dtype=torch.int16) for n in lengths]
    for step, rows in enumerate(t for t in trace if t):
        ids = torch.stack([layer[step] for layer in captured], dim=1).to("cpu", torch.int16)
        row = 0
        for index, first, n in rows:
            end = min(first + n, lengths[index])
            out[index][first:end] = ids[row : row + end - first]
            row += n
    return out
