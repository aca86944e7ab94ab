"""The strict vLLM model's attention as one opaque custom op, `rl_kernel::vllm_attention`.

What torch.compile sees of a layer's attention in the strict model (and where vLLM splits its piecewise CUDA
graphs, `compilation_config.splitting_ops`): one node taking q, k, v, an output buffer and the vLLM layer's name,
whose run writes k, v into that layer's KV cache and the attention over it into the buffer
(`RLKernelQwen3ForCausalLM._attention`, found through `register_layer`). Registered by the plugin's `register()`
in every vLLM process, before vLLM reads its compilation config.

Why the op fills a buffer instead of returning a tensor: under piecewise CUDA graphs the op runs eagerly between
two captured graphs, and a captured graph reads its inputs at the addresses they had at capture. A tensor the
op allocates has a new address at every replay, so the next graph would read a stale one; the buffer is
allocated by the graph before the op (`attend`), so its address is the captured one (vLLM's own attention ops
take an `output` for the same reason).
"""

from __future__ import annotations

import weakref

import torch

ATTENTION_OP = "rl_kernel::vllm_attention"  # the strict model's attention op: vLLM splits its piecewise graph here

_LAYERS: dict[str, tuple[weakref.ref, int]] = {}  # vLLM layer name -> (strict model, layer index)


def register_layer(name: str, model, index: int) -> None:
    """Let the op find `model`'s attention of layer `index` under vLLM's layer name `name`; `model` has
    `_attention(index, q, k, v, out)`, which fills `out` [T, H, d] and returns it."""
    _LAYERS[name] = (weakref.ref(model), index)


@torch.library.custom_op(
    ATTENTION_OP, mutates_args=("out",), schema="(Tensor q, Tensor k, Tensor v, Tensor(a!) out, str layer) -> ()"
)
def vllm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: str) -> None:
    if layer not in _LAYERS or _LAYERS[layer][0]() is None:
        raise KeyError(f"{ATTENTION_OP}: no strict model layer {layer!r} in this process")
    model, index = _LAYERS[layer]
    model()._attention(index, q, k, v, out)


@vllm_attention.register_fake
def _(q, k, v, out, layer):
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: str) -> torch.Tensor:
    """What the compiled forward runs for vLLM layer `layer`: a new contiguous [T, H, d] buffer (in the graph piece
    before the op) filled by `rl_kernel::vllm_attention`."""
    out = q.new_empty(q.shape)
    vllm_attention(q, k, v, out, layer)
    return out
