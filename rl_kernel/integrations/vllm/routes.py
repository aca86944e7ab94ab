"""The experts a vLLM engine routed each token to, per MoE layer: what the routing agreement between rollout and
trainer is measured on (vime's `consistency/routing_mismatch`).

`RouteRecorder(model_runner, top_k)` wraps the runner's `_model_forward` (vLLM's V1 runner calls it every step,
inside the forward context and outside any CUDA graph, which replays within it): after each forward its rows are
mapped to (request id, position) by the runner's input batch (vLLM lays the scheduled tokens out request by
request in its order, at the query start locations of the attention metadata) and each MoE layer's expert ids of
every row are kept.
- rl_kernel's strict model: the ids `rk.moe_route` picked, read from rows [0, T) of each `SparseMoeBlock`'s
  `route_buffer` (`allocate_route_buffers`: allocated at model build, before vLLM captures its graphs, and written
  by an in-graph device copy), so replayed decode steps (FULL_DECODE_ONLY on CUDA) are recorded like eager ones;
- vLLM's own model (native): the router logits of every `*.mlp.gate` layer (forward hooks: eager steps only), and
  the top k of their fp32 softmax (ties to the lower id, as vLLM's fused top-k on distinct values): the experts
  its fused MoE ran.
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


def route_buffer_rows(vllm_config) -> int:
    """The most token rows one forward of the engine can have: its max_num_batched_tokens, or its largest CUDA-graph
    capture size where that is larger (a replayed batch is padded to its graph's size)."""
    sizes = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None) or [0]
    return max(int(vllm_config.scheduler_config.max_num_batched_tokens), *(int(n) for n in sizes))


def allocate_route_buffers(model: nn.Module, rows: int) -> None:
    """Give each `SparseMoeBlock` of `model` its route buffer: int16 [rows, k] on its weights' device, -1 filled.
    Call before vLLM captures CUDA graphs (at model build): the graphs copy into these addresses."""
    for block in moe_blocks(model):
        device = block.gate.weight.device
        block.route_buffer = torch.full((rows, block.top_k), -1, dtype=torch.int16, device=device)


class RouteRecorder:
    """Records, per request id, each fed position's expert ids [layers, k] while attached to a model runner."""

    def __init__(self, model_runner, top_k: int):
        self.runner, self.top_k = model_runner, top_k
        self.model = model_runner.get_model()  # unwrapped from vLLM's CUDA-graph wrappers
        self.records: list[tuple[list[str], list[int], torch.Tensor, torch.Tensor]] = []
        self._layers: list[torch.Tensor] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        _decoder_layers(self.model)  # a causal LM's layout, else ValueError (the worker records nothing)
        blocks = moe_blocks(self.model)
        self.strict = bool(blocks)
        if self.strict:
            self._buffers = [block.route_buffer for block in blocks]
            if any(buffer is None for buffer in self._buffers):
                raise RuntimeError(
                    "route capture: the strict model's SparseMoeBlocks have no route_buffer (the model class must "
                    "call rl_kernel.integrations.vllm.routes.allocate_route_buffers at build)"
                )
        else:
            gates = [m for name, m in self.model.named_modules() if name.endswith("mlp.gate")]
            if not gates:
                raise ValueError("route capture: the engine's model has no MoE layer (no SparseMoeBlock, no mlp.gate)")
            self._handles += [g.register_forward_hook(self._gate) for g in gates]
        forward = getattr(model_runner, "_model_forward", None)
        if forward is None:
            raise RuntimeError(
                f"route capture: vLLM's model runner {type(model_runner).__name__} has no _model_forward to wrap"
            )
        self._forward, self._signature = forward, inspect.signature(forward)
        model_runner._model_forward = self._model_forward  # an instance attribute: `close` removes it

    def _gate(self, module, args, output) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        self._layers.append(torch.topk(probs, self.top_k, dim=-1).indices.sort(dim=-1).values)

    def _model_forward(self, *args, **kwargs):
        """The runner's forward, then this step's routes recorded (outside any CUDA graph, in its forward context)."""
        self._layers.clear()
        out = self._forward(*args, **kwargs)
        self._record(self._signature.bind(*args, **kwargs).arguments.get("positions"))
        return out

    def _record(self, positions: torch.Tensor | None) -> None:
        meta = _attention_metadata()
        if meta is None or positions is None or not (self.strict or self._layers):
            return
        qsl = meta.query_start_loc.to("cpu", torch.int64)
        requests = list(self.runner.input_batch.req_ids[: qsl.numel() - 1])
        rows = int(qsl[-1])
        layers = self._buffers if self.strict else self._layers
        ids = torch.stack([layer[:rows] for layer in layers], dim=1).to("cpu", torch.int16)
        positions = positions[:rows].to("cpu", copy=True)  # vLLM reuses its positions buffer every step
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
        self.runner.__dict__.pop("_model_forward", None)


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
