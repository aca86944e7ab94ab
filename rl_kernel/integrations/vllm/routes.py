"""The experts a vLLM engine routed each token to, per MoE layer: what the routing agreement between rollout and
trainer is measured on (vime's `consistency/routing_mismatch`).

`RouteRecorder(model_runner, top_k)` hooks the runner's model: each forward's rows are mapped to (request id,
position) by the runner's input batch (vLLM lays the scheduled tokens out request by request in its order, at
the query start locations of the attention metadata) and each MoE layer's expert ids of every row are kept.
- rl_kernel's strict model: the ids `rk.moe_route` picked (`SparseMoeBlock.routes`);
- vLLM's own model (native): the router logits of every `*.mlp.gate` layer, and the top k of their fp32
  softmax (ties to the lower id, as vLLM's fused top-k on distinct values): the experts its fused MoE ran.
Ids ascending per token. Rows of vLLM's warm-up and profiling runs (no attention metadata) are skipped.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from rl_kernel.models.qwen3_moe import moe_blocks


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a vLLM causal LM (`model.model.layers`, the strict and vLLM's own models alike)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"route capture: {type(model).__name__} has no model.layers")
    return layers


def _attention_metadata():
    """The current forward's attention metadata of any layer (one batch: the same query start locations)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):
        meta = meta[0] if meta else None
    if isinstance(meta, dict):
        meta = next(iter(meta.values()), None)
    return meta


class RouteRecorder:
    """Records, per request id, each fed position's expert ids [layers, k] while attached to a model runner."""

    def __init__(self, model_runner, top_k: int):
        self.runner, self.top_k = model_runner, top_k
        self.model = model_runner.get_model()  # unwrapped from vLLM's CUDA-graph wrappers
        self.records: list[tuple[list[str], list[int], torch.Tensor, torch.Tensor]] = []
        self._layers: list[torch.Tensor] = []
        self._positions: torch.Tensor | None = None
        # vLLM's compile decorator replaces the model classes' __call__ (no module hooks there): the forward's start
        # and end are the first and last decoder layer's, whose `positions` argument the rows' positions are
        layers = _decoder_layers(self.model)
        self._signature = inspect.signature(layers[0].forward)
        self._handles = [
            layers[0].register_forward_pre_hook(self._before, with_kwargs=True),
            layers[-1].register_forward_hook(self._after),
        ]
        self.strict = bool(moe_blocks(self.model))
        if self.strict:
            for block in moe_blocks(self.model):
                block.routes = self._layers
        else:
            gates = [m for name, m in self.model.named_modules() if name.endswith("mlp.gate")]
            if not gates:
                raise ValueError("route capture: the engine's model has no MoE layer (no SparseMoeBlock, no mlp.gate)")
            self._handles += [g.register_forward_hook(self._gate) for g in gates]

    def _gate(self, module, args, output) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        self._layers.append(torch.topk(probs, self.top_k, dim=-1).indices.sort(dim=-1).values)

    def _before(self, module, args, kwargs) -> None:
        self._layers.clear()
        self._positions = self._signature.bind(*args, **kwargs).arguments.get("positions")

    def _after(self, module, args, output) -> None:
        meta = _attention_metadata()
        if meta is None or self._positions is None or not self._layers:
            return
        qsl = meta.query_start_loc.to("cpu", torch.int64)
        requests = list(self.runner.input_batch.req_ids[: qsl.numel() - 1])
        rows = int(qsl[-1])
        ids = torch.stack([layer[:rows] for layer in self._layers], dim=1).to("cpu", torch.int16)
        positions = self._positions[:rows].to("cpu", copy=True)  # vLLM reuses its positions buffer every step
        self.records.append((requests, qsl.tolist(), positions, ids))

    def take(self) -> dict[str, dict[str, list]]:
        """{request id: {"positions": [p, ...], "experts": [[[ids of layer 0], ...], ...]}} since the last take."""
        out: dict[str, dict[str, list]] = {}
        for requests, qsl, positions, ids in self.records:
            for i, rid in enumerate(requests):
                a, b = qsl[i], qsl[i + 1]
                entry = out.setdefault(rid, {"positions": [], "experts": []})
                entry["positions"] += positions[a:b].tolist()
                entry["experts"] += ids[a:b].tolist()
        self.records.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        for block in moe_blocks(self.model):
            block.routes = None


def routes_of(records: dict[str, dict[str, list]], request_id: str, length: int) -> torch.Tensor | None:
    """int16 [length, layers, k]: the recorded expert ids of positions 0..length-1 of the engine request whose
    external id is `request_id` (vLLM suffixes the ids it runs with "-<8 hex>"), -1 where none was recorded (a
    prefix-cache hit: another request computed that position); None when nothing was recorded."""
    mine = [r for rid, r in records.items() if rid == request_id or rid.rsplit("-", 1)[0] == request_id]
    if not mine or not mine[0]["experts"]:
        return None
    layers, k = len(mine[0]["experts"][0]), len(mine[0]["experts"][0][0])
    out = torch.full((length, layers, k), -1, dtype=torch.int16)
    for r in mine:
        for p, e in zip(r["positions"], r["experts"]):
            if p < length:
                out[p] = torch.tensor(e, dtype=torch.int16)
    return out
