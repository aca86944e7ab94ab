"""The strict vLLM model's attention as one opaque custom op, `rl_kernel::vllm_attention`.

What torch.compile sees of a layer's attention in the strict model (and where vLLM splits its piecewise CUDA
graphs, `compilation_config.splitting_ops`): one node taking q, k, v and the vLLM layer's name, whose run writes
k, v into that layer's KV cache and attends over it (`RLKernelQwen3ForCausalLM._attention`, found through
`register_layer`). Registered by the plugin's `register()` in every vLLM process, before vLLM reads its
compilation config.
"""

from __future__ import annotations

import weakref

import torch

ATTENTION_OP = "rl_kernel::vllm_attention"  # the strict model's attention op: vLLM splits its piecewise graph here

_LAYERS: dict[str, tuple[weakref.ref, int]] = {}  # vLLM layer name -> (strict model, layer index)


def register_layer(name: str, model, index: int) -> None:
    """Let the op find `model`'s attention of layer `index` under vLLM's layer name `name`."""
    _LAYERS[name] = (weakref.ref(model), index)


@torch.library.custom_op(ATTENTION_OP, mutates_args=(), schema="(Tensor q, Tensor k, Tensor v, str layer) -> Tensor")
def vllm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: str) -> torch.Tensor:
    if layer not in _LAYERS or _LAYERS[layer][0]() is None:
        raise KeyError(f"{ATTENTION_OP}: no strict model layer {layer!r} in this process")
    model, index = _LAYERS[layer]
    return model()._attention(index, q, k, v).contiguous()


@vllm_attention.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
