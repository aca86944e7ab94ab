"""Qwen3 (dense) for vLLM: a thin wrapper over rl_kernel's shared Qwen3 blocks.

Registered as `RLKernelQwen3ForCausalLM` (see `rl_kernel.integrations.vllm.register`). vLLM keeps its
scheduler, continuous batching, chunked prefill, prefix caching and paged KV cache; the forward is
`rl_kernel.models.layers.Qwen3Model` (the reference model's blocks: every number computed by
rl_kernel ops, row-parallel reductions in rank order over vLLM's gloo CPU TP group, vocab-parallel
embedding and LM head gathered as bit copies; rl_kernel modes from the engine's `additional_config`,
set in every process that builds the model). This module supplies only:

- the attention function: `rk.write_kv_cache`'s copy + `rk.paged_attention` over vLLM's own KV cache
  tensor, with the block table, sequence lengths, query start locations and slot mapping of vLLM's
  attention metadata (vLLM's attention kernels never run);
- `compute_logits`: the fp32 logits of the whole vocab (input to the strict logits processor's
  `rk.log_softmax`);
- weight loading from HF checkpoint names, sharded by `rl_kernel.models.qwen3_layout` (the table the
  reference and the Megatron conversion use; kv heads replicated when tp > num_kv_heads).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import rl_kernel as rk
from rl_kernel.integrations.vllm import MODES_KEY
from rl_kernel.models.layers import Qwen3Model
from rl_kernel.models.qwen3 import Qwen3Config
from rl_kernel.models.qwen3_layout import weight_layout
from rl_kernel.modes import full_modes

SUPPORTED_MODEL_TYPES = ("qwen3",)


def _cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU KV cache [num_blocks, Hkv, block_size, 2d] holds, per block and kv head, block_size
    key rows of d then block_size value rows of d. Views [num_blocks, block_size, Hkv, d] of each."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    kv = kv_cache.view(blocks, kv_heads, 2 * block_size, -1)
    return kv[:, :, :block_size].transpose(1, 2), kv[:, :, block_size:].transpose(1, 2)


def _write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """rk.write_kv_cache's copy, on the strided (head-major) views of vLLM's cache."""
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0  # vLLM marks padded tokens with slot -1
    slots = slots[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = torch.div(slots, block_size, rounding_mode="floor"), slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def _paged_attention(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """rk.paged_attention over the blocks this batch uses, gathered into a compact contiguous cache
    (a bit copy; the contract makes the result independent of the physical block placement)."""
    seq_lens = meta.seq_lens.to(torch.int64)
    block_size = k_cache.shape[1]
    width = int(torch.div(seq_lens.max() + block_size - 1, block_size, rounding_mode="floor"))
    table = meta.block_table[: seq_lens.shape[0], :width].to(torch.int64)
    used, local_table = torch.unique(table, return_inverse=True)
    return rk.paged_attention(q, k_cache[used].contiguous(), v_cache[used].contiguous(), local_table,
                              seq_lens, meta.query_start_loc, scale)


class RLKernelQwen3ForCausalLM(nn.Module):
    """vLLM model class (V1 interface: forward -> hidden states, compute_logits -> fp32 logits)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm.distributed import get_tp_group
        from vllm.model_executor.layers.attention import Attention

        super().__init__()
        config = vllm_config.model_config.hf_config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"rl_kernel's strict vLLM model supports Qwen3 (dense) checkpoints only "
                             f"(model_type {SUPPORTED_MODEL_TYPES}); this checkpoint has model_type "
                             f"{config.model_type!r}. Run it in native mode (plain vLLM) instead.")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("the strict Qwen3 model does not support pipeline parallelism; use tensor parallelism")
        modes = (vllm_config.additional_config or {}).get(MODES_KEY)
        if modes is None:  # fail closed: this process's environment does not decide what the engine runs
            raise ValueError(f"rl_kernel's strict vLLM model was started without explicit rl_kernel modes "
                             f"(additional_config[{MODES_KEY!r}]): build the engine arguments with "
                             "rl_kernel.integrations.vllm.strict_llm_kwargs(model, modes)")
        for boundary, mode in full_modes(modes).items():
            rk.set_mode(mode, boundary)
        self.config = config
        self.shape = Qwen3Config.from_hf({**config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}, "hf_config")
        self.vocab_size = config.vocab_size
        tp = get_tp_group()
        self.model = Qwen3Model(self.shape, tp.cpu_group if tp.world_size > 1 else None,
                                vllm_config.model_config.dtype)
        s = self.model.shape
        # vLLM's Attention layers are kept only so that vLLM allocates, binds and schedules each layer's
        # paged KV cache; their forward (vLLM's attention kernels) is never called.
        self.attn = nn.ModuleList(
            Attention(s.heads, self.shape.head_dim, self.model.scale, num_kv_heads=s.kv_heads,
                      cache_config=vllm_config.cache_config, prefix=f"{prefix}model.layers.{i}.self_attn.attn")
            for i in range(self.shape.num_layers))

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Paged attention over vLLM's KV cache of `layer` (the new tokens' k, v written first)."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        out = torch.zeros_like(q)
        meta, _, kv_cache, slot_mapping = get_attention_context(self.attn[layer].layer_name)
        if meta is not None:  # None only in vLLM's warm-up / profiling runs
            n = meta.num_actual_tokens
            k_cache, v_cache = _cache_views(kv_cache)
            _write_kv(k[:n], v[:n], k_cache, v_cache, meta.slot_mapping if slot_mapping is None else slot_mapping[:n])
            out[:n] = _paged_attention(q[:n], k_cache, v_cache, meta, self.model.scale)
        return out

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, self._attention, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab_size] under the GEMM contract, unrounded (input to rk.log_softmax)."""
        return self.model.lm_head.logits(hidden_states)[:, : self.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named full tensors (any subset), sharded for this TP rank by the layout table."""
        layout, views = weight_layout(self.shape), self.model.hf_views()
        names = {id(p): n for n, p in self.named_parameters()}
        loaded = set()
        for name, w in weights:
            if name == "lm_head.weight" and self.shape.tie_word_embeddings:
                continue  # tied: the LM head is the embedding
            if name not in layout:
                raise KeyError(f"unexpected Qwen3 weight {name!r} for the strict model")
            with torch.no_grad():
                views[name].copy_(layout[name].shard(w, self.model.rank, self.model.tp))
            loaded.add(names[id(self.model.get_parameter(layout[name].module))])
        return loaded
