"""Qwen3 (dense) for vLLM with rl_kernel ops at every boundary.

Registered as `RLKernelQwen3ForCausalLM` (see `rl_kernel.integrations.vllm.register`). vLLM keeps its
scheduler, continuous batching, chunked prefill, prefix caching and paged KV cache; this module
computes every number on the forward path:

- embedding: vocab-parallel lookup, ranks' rows gathered and the owner's row picked (a bit copy);
- RMSNorm (with residual), QK-norm: `rk.rms_norm`; QKV, gate/up: `rk.linear` on this rank's rows;
  O and down projections: `rk.row_parallel_linear` over vLLM's TP group (gloo CPU group), whose
  fp32 partials are tree-reduced in rank order instead of vLLM's all-reduce;
- RoPE: `rk.rope`; SwiGLU: `rk.silu_and_mul`;
- attention: `rk.write_kv_cache` + `rk.paged_attention` over vLLM's own KV cache tensor, with the
  block table, sequence lengths, query start locations and slot mapping of vLLM's attention
  metadata (vLLM's attention kernels never run);
- LM head: `rk.linear_fp32` on this rank's vocab rows; `compute_logits` returns the fp32 logits of
  the whole vocab (ranks' columns gathered: a bit copy), which the strict logits processor turns
  into `rk.log_softmax` log-probs.

Weights load from the HF checkpoint names and are sharded as vLLM shards them (heads and MLP rows
for column-parallel, K columns for row-parallel, vocab rows for embedding and LM head).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

import rl_kernel as rk

SUPPORTED_MODEL_TYPES = ("qwen3",)


class _TP:
    """vLLM's tensor-parallel group as rl_kernel sees it: rank, size and the gloo CPU group."""

    def __init__(self) -> None:
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        self.rank, self.size = tp.rank_in_group, tp.world_size
        self.group = tp.cpu_group if tp.world_size > 1 else None

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' x along the last dim, in rank order (a bit copy)."""
        if self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _rows(full: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    size = full.shape[0] // parts
    return full[rank * size:(rank + 1) * size]


class StrictAttention(nn.Module):
    def __init__(self, config, tp: _TP, cache_config, prefix: str, dtype: torch.dtype) -> None:
        from vllm.model_executor.layers.attention import Attention

        super().__init__()
        self.tp = tp
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % tp.size or (kv_heads % tp.size and tp.size % kv_heads):
            raise ValueError(f"tensor_parallel_size={tp.size} must divide num_attention_heads={heads} and divide "
                             f"or be a multiple of num_key_value_heads={kv_heads}")
        self.heads, self.kv_heads = heads // tp.size, max(1, kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // kv_heads)  # ranks sharing one kv head when kv_heads < tp
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.theta = float(config.rope_parameters["rope_theta"])
        d, h = self.head_dim, config.hidden_size
        self.qkv_weight = nn.Parameter(torch.empty((self.heads + 2 * self.kv_heads) * d, h, dtype=dtype),
                                       requires_grad=False)
        self.o_weight = nn.Parameter(torch.empty(h, self.heads * d, dtype=dtype), requires_grad=False)
        self.q_norm = nn.Parameter(torch.empty(d, dtype=dtype), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(d, dtype=dtype), requires_grad=False)
        # vLLM's Attention layer is kept only so that vLLM allocates, binds and schedules this layer's
        # paged KV cache; its forward (vLLM's CPU attention kernels) is never called.
        self.attn = Attention(self.heads, d, self.scale, num_kv_heads=self.kv_heads, cache_config=cache_config,
                              prefix=f"{prefix}.attn")

    def load(self, name: str, w: torch.Tensor) -> nn.Parameter:
        d, rank = self.head_dim, self.tp.rank
        q_rows, kv_rows = self.heads * d, self.kv_heads * d
        if name == "q_proj.weight":
            self.qkv_weight.data[:q_rows].copy_(_rows(w, rank, self.tp.size))
            return self.qkv_weight
        if name in ("k_proj.weight", "v_proj.weight"):
            start = q_rows if name == "k_proj.weight" else q_rows + kv_rows
            kv_rank = rank // self.kv_replicas
            self.qkv_weight.data[start:start + kv_rows].copy_(w[kv_rank * kv_rows:(kv_rank + 1) * kv_rows])
            return self.qkv_weight
        if name == "o_proj.weight":
            self.o_weight.data.copy_(_rows(w.T, rank, self.tp.size).T)
            return self.o_weight
        if name in ("q_norm.weight", "k_norm.weight"):
            target = self.q_norm if name == "q_norm.weight" else self.k_norm
            target.data.copy_(w)
            return target
        raise KeyError(f"unexpected Qwen3 attention weight {name!r}")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from vllm.model_executor.layers.attention.attention import get_attention_context

        t, d = x.shape[0], self.head_dim
        qkv = rk.linear(x, self.qkv_weight)
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = rk.rope(rk.rms_norm(q.reshape(t, self.heads, d), self.q_norm, self.eps), positions, self.theta)
        k = rk.rope(rk.rms_norm(k.reshape(t, self.kv_heads, d), self.k_norm, self.eps), positions, self.theta)
        v = v.reshape(t, self.kv_heads, d)
        out = torch.zeros(t, self.heads, d, dtype=x.dtype, device=x.device)
        meta, _, kv_cache, slot_mapping = get_attention_context(self.attn.layer_name)
        if meta is not None:  # None only in vLLM's warm-up / profiling runs
            n = meta.num_actual_tokens
            k_cache, v_cache = _cache_views(kv_cache)
            _write_kv(k[:n], v[:n], k_cache, v_cache, meta.slot_mapping if slot_mapping is None else slot_mapping[:n])
            out[:n] = _paged_attention(q[:n], k_cache, v_cache, meta, self.scale)
        return rk.row_parallel_linear(out.reshape(t, self.heads * d), self.o_weight, self.tp.group)


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


class StrictMLP(nn.Module):
    def __init__(self, config, tp: _TP, dtype: torch.dtype) -> None:
        super().__init__()
        if config.intermediate_size % tp.size:
            raise ValueError(f"intermediate_size={config.intermediate_size} is not divisible by tp={tp.size}")
        self.tp = tp
        self.inter = config.intermediate_size // tp.size
        self.gate_up_weight = nn.Parameter(torch.empty(2 * self.inter, config.hidden_size, dtype=dtype),
                                           requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(config.hidden_size, self.inter, dtype=dtype), requires_grad=False)

    def load(self, name: str, w: torch.Tensor) -> nn.Parameter:
        if name in ("gate_proj.weight", "up_proj.weight"):
            rows = slice(0, self.inter) if name == "gate_proj.weight" else slice(self.inter, 2 * self.inter)
            self.gate_up_weight.data[rows].copy_(_rows(w, self.tp.rank, self.tp.size))
            return self.gate_up_weight
        if name == "down_proj.weight":
            self.down_weight.data.copy_(_rows(w.T, self.tp.rank, self.tp.size).T)
            return self.down_weight
        raise KeyError(f"unexpected Qwen3 MLP weight {name!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rk.row_parallel_linear(rk.silu_and_mul(rk.linear(x, self.gate_up_weight)), self.down_weight,
                                      self.tp.group)


class StrictDecoderLayer(nn.Module):
    def __init__(self, config, tp: _TP, cache_config, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.self_attn = StrictAttention(config, tp, cache_config, f"{prefix}.self_attn", dtype)
        self.mlp = StrictMLP(config, tp, dtype)
        self.input_layernorm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype),
                                                     requires_grad=False)

    def forward(self, positions, h, residual):
        if residual is None:
            residual, x = h, rk.rms_norm(h, self.input_layernorm, self.eps)
        else:
            x, residual = rk.rms_norm(h, self.input_layernorm, self.eps, residual)
        x, residual = rk.rms_norm(self.self_attn(positions, x), self.post_attention_layernorm, self.eps, residual)
        return self.mlp(x), residual


class RLKernelQwen3ForCausalLM(nn.Module):
    """vLLM model class (V1 interface: forward -> hidden states, compute_logits -> fp32 logits)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"rl_kernel's strict vLLM model supports Qwen3 (dense) checkpoints only "
                             f"(model_type {SUPPORTED_MODEL_TYPES}); this checkpoint has model_type "
                             f"{config.model_type!r}. Run it in native mode (plain vLLM) instead.")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("the strict Qwen3 model does not support pipeline parallelism; use tensor parallelism")
        self.config = config
        self.tp = _TP()
        dtype = vllm_config.model_config.dtype
        self.vocab_size = config.vocab_size
        self.vocab_local = -(-config.vocab_size // self.tp.size)  # padded rows (zeros) are never selected
        self.embed_tokens = nn.Parameter(torch.zeros(self.vocab_local, config.hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.lm_head = nn.Parameter(torch.zeros(self.vocab_local, config.hidden_size, dtype=dtype),
                                    requires_grad=False)
        self.layers = nn.ModuleList(
            StrictDecoderLayer(config, self.tp, vllm_config.cache_config, f"{prefix}model.layers.{i}", dtype)
            for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids.to(torch.int64) - self.tp.rank * self.vocab_local
        rows = self.embed_tokens[local.clamp(0, self.vocab_local - 1)]
        if self.tp.group is None:
            return rows
        parts = [torch.empty_like(rows) for _ in range(self.tp.size)]
        dist.all_gather(parts, rows.contiguous(), group=self.tp.group)
        owner = torch.div(input_ids.to(torch.int64), self.vocab_local, rounding_mode="floor")
        return torch.stack(parts)[owner, torch.arange(rows.shape[0], device=rows.device)]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = rk.rms_norm(h, self.norm, self.config.rms_norm_eps, residual)
        return h

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab_size] under the GEMM contract, unrounded (input to rk.log_softmax)."""
        return self.tp.gather_last(rk.linear_fp32(hidden_states, self.lm_head))[:, : self.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named full tensors (any subset), sharding them for this TP rank."""
        params = {id(p): n for n, p in self.named_parameters()}
        loaded = set()
        for name, w in weights:
            loaded.update(params[id(p)] for p in self._load_one(name, w))
        return loaded

    def _load_one(self, name: str, w: torch.Tensor) -> list[nn.Parameter]:
        """Copy one HF tensor into this rank's shard(s); returns the parameters it filled."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            targets = [self.embed_tokens] if name.startswith("model.") else [self.lm_head]
            if name.startswith("model.") and getattr(self.config, "tie_word_embeddings", False):
                targets.append(self.lm_head)
            rows = w[self.tp.rank * self.vocab_local:(self.tp.rank + 1) * self.vocab_local]
            for target in targets:
                target.data[: rows.shape[0]].copy_(rows)
            return targets
        if name == "model.norm.weight":
            self.norm.data.copy_(w)
            return [self.norm]
        if name.startswith("model.layers."):
            index, sub, leaf = name[len("model.layers."):].split(".", 2)
            layer = self.layers[int(index)]
            if sub in ("self_attn", "mlp"):
                return [getattr(layer, sub).load(leaf, w)]
            if leaf == "weight" and sub in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, sub).data.copy_(w)
                return [getattr(layer, sub)]
        raise KeyError(f"unexpected Qwen3 weight {name!r} for the strict model")
