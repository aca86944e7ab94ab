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
from collections.abc import Iterator

import torch
from torch import nn

from rl_kernel.models.qwen3 import MOE_KEYS, UNSUPPORTED_KEYS, Qwen3MoeConfig  # noqa: F401  (defined beside Qwen3Config)


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
