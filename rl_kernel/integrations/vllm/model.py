"""Qwen3 (dense) for vLLM: a thin wrapper over rl_kernel's shared Qwen3 blocks.

Registered as `RLKernelQwen3ForCausalLM` (see `rl_kernel.integrations.vllm.register`). vLLM keeps its
scheduler, continuous batching, chunked prefill, prefix caching and paged KV cache; the forward is
`rl_kernel.models.layers.Qwen3Model` (the reference model's blocks: every number computed by
rl_kernel ops, row-parallel reductions as an all-gather of the partials then a rank-order sum,
vocab-parallel embedding and LM head gathered as bit copies, the gathers over vLLM's device
communicator by default (`tp_group`: NCCL on CUDA); rl_kernel modes from the engine's
`additional_config`, set in every process that builds the model). This module supplies only:

- the attention function: `rk.write_kv_cache`'s copy + `rk.paged_attention` over vLLM's own KV cache
  tensor, with the block table, sequence lengths, query start locations and slot mapping of vLLM's
  attention metadata (vLLM's attention kernels never run). It reads the CPU backend's cache layout and
  FlashAttention's (`kv_cache_views`); on the latter the write and the attention have fixed shapes and
  no host sync, for vLLM's CUDA graphs of decode batches (ran on one H200, TP1: docs/vllm.md);
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
from rl_kernel.integrations.vllm import COMPILE_KEY, LOGITS_PROCESSOR, MODES_KEY, TP_COLLECTIVE_KEY
from rl_kernel.integrations.vllm.attention_op import attend, register_layer
from rl_kernel.integrations.vllm.warmup import uses_triton, warm_up
from rl_kernel.models.layers import Qwen3Model
from rl_kernel.models.qwen3 import Qwen3Config
from rl_kernel.models.qwen3_layout import weight_layout
from rl_kernel.modes import full_modes
from rl_kernel.ops.collective import use_gather
from vllm.compilation.decorators import support_torch_compile

SUPPORTED_MODEL_TYPES = ("qwen3",)


KV_CACHE_BACKENDS = ("CPU_ATTN", "FLASH_ATTN")  # vLLM attention backends whose KV cache the model reads


def _contiguous_blocks(cache: torch.Tensor) -> bool:
    """A [num_blocks, block_size, Hkv, d] view whose blocks rk.paged_attention reads as they are:
    stride(0) == block_size * stride(1) and a unit last stride."""
    return cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * cache.stride(1)


def _layout_error(backend: str, kv_cache: torch.Tensor, why: str) -> ValueError:
    return ValueError(
        f"rl_kernel's strict vLLM model cannot read the {backend} KV cache "
        f"{list(kv_cache.shape)} (strides {list(kv_cache.stride())}): {why}; supported: CPU_ATTN, "
        f"and FLASH_ATTN in a layout with contiguous blocks (vLLM's default for it, LBNHC)"
    )


def kv_cache_views(kv_cache: torch.Tensor, backend: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache): views [num_blocks, block_size, Hkv, head_dim] of one layer's vLLM KV cache, no copy.

    vLLM hands every backend the logical shape [num_blocks, Hkv, block_size, 2 * head_dim], in the physical
    order of its resolved KVCacheLayout; what the last axis holds depends on the backend (`backend`, the
    layer's `get_attn_backend().get_name()`):
    - CPU_ATTN (layout LBHNC): per block and kv head, block_size key rows then block_size value rows;
    - FLASH_ATTN: per token and kv head, its key then its value. Accepted only in a layout whose blocks are
      contiguous (`_contiguous_blocks`: vLLM's default for FlashAttention, LBNHC), which rk.paged_attention
      reads in place.
    Raises a one-line ValueError for another backend, another shape, or FLASH_ATTN in another layout.
    """
    if backend not in KV_CACHE_BACKENDS:
        raise _layout_error(backend, kv_cache, "unknown backend")
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_dim:
        raise _layout_error(backend, kv_cache, f"expected [num_blocks, kv_heads, block_size, {2 * head_dim}]")
    blocks, kv_heads, block_size, _ = kv_cache.shape
    if backend == "CPU_ATTN":
        kv = kv_cache.view(blocks, kv_heads, 2 * block_size, head_dim)
        return kv[:, :, :block_size].transpose(1, 2), kv[:, :, block_size:].transpose(1, 2)
    k_cache, v_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    if not _contiguous_blocks(k_cache):
        raise _layout_error(backend, kv_cache, "its blocks are not contiguous")
    return k_cache, v_cache


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copy k, v [T, Hkv, d] into the views k_cache, v_cache [num_blocks, block_size, Hkv, d] at the flat
    slots slot_mapping [T] (block * block_size + offset); slot -1 (vLLM's padding) changes nothing.

    Safe to capture in a CUDA graph: fixed shapes, no host sync. Every token is written, a padded one as a
    repeat of the first real token's write (same slot, same bits, so the order of duplicate writes does not
    matter), or, when no token is real, as slot 0's own content written back.
    """
    slots = slot_mapping.to(torch.int64)
    if slots.numel() == 0:
        return
    real = slots >= 0
    first = real.to(torch.int32).argmax().view(1)  # first real token; 0 when there is none
    any_real = real.index_select(0, first)
    slots = torch.where(real, slots, torch.where(any_real, slots.index_select(0, first), 0))
    block_size = k_cache.shape[1]
    blocks, offsets = torch.div(slots, block_size, rounding_mode="floor"), slots % block_size
    for new, cache in ((k, k_cache), (v, v_cache)):
        values = new.to(cache.dtype)
        anchor = torch.where(any_real.view(1, 1, 1), values.index_select(0, first), cache[0, 0].unsqueeze(0))
        cache[blocks, offsets] = torch.where(real.view(-1, 1, 1), values, anchor)


def _vllm_cache_writer():
    """vLLM's own KV-cache write for its FlashAttention layout (`reshape_and_cache_flash`, a copy: the bits of k
    and v land unchanged, padding slots -1 skipped, one kernel), or None where this vLLM build has none (CPU)."""
    import importlib

    for module in ("vllm.v1.attention.backends.fa_utils", "vllm._custom_ops"):
        try:
            writer = importlib.import_module(module).reshape_and_cache_flash
        except (ImportError, AttributeError):
            continue
        if writer is not None:
            return writer
    return None


def write_kv_flash(
    writer,
    attn,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`write_kv` through vLLM's FlashAttention cache write: the same bytes in the cache, one kernel instead of
    about twenty (capture-safe like vLLM's own). Only an unquantized cache of k's dtype keeps k and v's bits."""
    if k_cache.dtype != k.dtype:
        raise ValueError(
            f"rl_kernel's strict vLLM model writes K/V bit for bit: the KV cache must be {k.dtype} "
            f"(kv_cache_dtype='auto'), got {k_cache.dtype}"
        )
    writer(k, v, k_cache, v_cache, slot_mapping, "auto", attn._k_scale, attn._v_scale)


def _paged_attention_in_place(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """rk.paged_attention on vLLM's physical cache (contiguous blocks) with vLLM's block table as it is:
    no host sync, shapes fixed by the batch's shapes (CUDA-graph safe with a capture-safe backend). Query
    rows past query_start_loc[-1] (the tokens vLLM pads a CUDA-graph batch with) are no sequence's: the Triton
    backend returns them as 0 (docs/vllm.md, padding rows)."""
    seq_lens = meta.seq_lens
    return rk.paged_attention(
        q, k_cache, v_cache, meta.block_table[: seq_lens.shape[0]], seq_lens, meta.query_start_loc, scale
    )


def _paged_attention_compact(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """rk.paged_attention over the blocks this batch uses, gathered into a compact contiguous cache
    (a bit copy; the contract makes the result independent of the physical block placement). Host syncs:
    for caches without contiguous blocks (vLLM's CPU layout), which run eager."""
    seq_lens = meta.seq_lens.to(torch.int64)
    block_size = k_cache.shape[1]
    width = int(torch.div(seq_lens.max() + block_size - 1, block_size, rounding_mode="floor"))
    table = meta.block_table[: seq_lens.shape[0], :width].to(torch.int64)
    used, local_table = torch.unique(table, return_inverse=True)
    return rk.paged_attention(
        q, k_cache[used].contiguous(), v_cache[used].contiguous(), local_table, seq_lens, meta.query_start_loc, scale
    )


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Attention of q [T, H, d] over the cache views (`kv_cache_views`) with vLLM's attention metadata `meta`
    (`seq_lens`, `block_table`, `query_start_loc`): in place where the blocks are contiguous (CUDA-graph
    safe), else over a compact copy of the used blocks. Both give the same bits (rk.paged_attention's
    result does not depend on where the blocks are nor on the table's width)."""
    if _contiguous_blocks(k_cache) and _contiguous_blocks(v_cache):
        return _paged_attention_in_place(q, k_cache, v_cache, meta, scale)
    return _paged_attention_compact(q, k_cache, v_cache, meta, scale)


def tp_group(tp, collective: str = "device"):
    """The process group the strict model's TP collectives run over (None: TP1), from vLLM's TP
    GroupCoordinator `tp`: "device", its device group, whose all-gathers go through vLLM's device communicator
    (`tp.all_gather`: NCCL on CUDA, capturable under vLLM's CUDA graphs; shared memory on CPU); "cpu", its gloo
    CPU group over torch.distributed (host memory). The merge after the gather is the same either way."""
    if tp.world_size == 1:
        return None
    if collective == "cpu":
        return tp.cpu_group
    use_gather(tp.device_group, lambda t: tp.all_gather(t, dim=0))
    return tp.device_group


def _check_strict_sampling(vllm_config) -> None:
    """Fail closed unless the engine samples from strict log-probs: vLLM's V1 model runner with the strict logits
    processor among its logits processors."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise rk.StrictModeError(
            "logprobs",
            "vllm",
            "vLLM's V2 model runner samples without the strict logits processor: build the engine with "
            "strict_llm_kwargs (whose processor keeps vLLM on its V1 runner) and leave VLLM_USE_V2_MODEL_RUNNER unset",
        )
    processors = vllm_config.model_config.logits_processors or ()
    named = [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}" for p in processors]
    if LOGITS_PROCESSOR not in named:
        raise ValueError(
            "rl_kernel's strict vLLM model is on vLLM's V1 model runner without the strict logits processor "
            f"({LOGITS_PROCESSOR}): build the engine with strict_llm_kwargs"
        )


def _compiled(vllm_config) -> bool:
    """Whether vLLM compiles the strict model's forward: only where strict_llm_kwargs(compile=True) asked."""
    return bool((vllm_config.additional_config or {}).get(COMPILE_KEY))


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0}, enable_if=_compiled)
class RLKernelQwen3ForCausalLM(nn.Module):
    """vLLM model class (V1 interface: forward -> hidden states, compute_logits -> fp32 logits).

    Compiled by vLLM (torch.compile, piecewise CUDA graphs split at `rl_kernel::vllm_attention`) only when the
    engine was built with `strict_llm_kwargs(..., compile=True)`: every number of the traced forward is then
    computed inside an opaque rl_kernel custom op (`rl_kernel.ops.library`, `attention_op`), so compiled and eager
    give the same bits."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm.distributed import get_tp_group
        from vllm.model_executor.layers.attention import Attention

        super().__init__()
        config = vllm_config.model_config.hf_config
        if config.model_type not in self.model_types:
            raise ValueError(
                f"rl_kernel's strict vLLM model {type(self).__name__} supports model_type {self.model_types} "
                f"only; this checkpoint has model_type {config.model_type!r}. Run it in native mode (plain vLLM) "
                "instead."
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("the strict Qwen3 model does not support pipeline parallelism; use tensor parallelism")
        modes = (vllm_config.additional_config or {}).get(MODES_KEY)
        if modes is None:  # fail closed: this process's environment does not decide what the engine runs
            raise ValueError(
                f"rl_kernel's strict vLLM model was started without explicit rl_kernel modes "
                f"(additional_config[{MODES_KEY!r}]): build the engine arguments with "
                "rl_kernel.integrations.vllm.strict_llm_kwargs(model, modes)"
            )
        for boundary, mode in full_modes(modes).items():
            rk.set_mode(mode, boundary)
        _check_strict_sampling(vllm_config)
        self.config = config
        self.shape = self.read_shape(config)
        self.vocab_size = config.vocab_size
        tp = get_tp_group()
        collective = (vllm_config.additional_config or {}).get(TP_COLLECTIVE_KEY, "device")
        self.tp_collective = collective if tp.world_size > 1 else None  # what rl_kernel_tp_collective reports
        self.model = Qwen3Model(self.shape, tp_group(tp, collective), vllm_config.model_config.dtype)
        s = self.model.shape
        # vLLM's Attention layers are kept only so that vLLM allocates, binds and schedules each layer's
        # paged KV cache; their forward (vLLM's attention kernels) is never called.
        self.attn = nn.ModuleList(
            Attention(
                s.heads,
                self.shape.head_dim,
                self.model.scale,
                num_kv_heads=s.kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.self_attn.attn",
            )
            for i in range(self.shape.num_layers)
        )
        for i, attn in enumerate(self.attn):
            register_layer(attn.layer_name, self, i)
        self._flash_writer = _vllm_cache_writer() if vllm_config.device_config.device_type == "cuda" else None
        sched = vllm_config.scheduler_config
        self._warm_up = dict(
            max_tokens=sched.max_num_batched_tokens,
            max_seqs=sched.max_num_seqs,
            block_size=vllm_config.cache_config.block_size,
            max_model_len=vllm_config.model_config.max_model_len,
        )
        self.warmed_up: list[int] | None = None  # the token counts the Triton warm-up ran, once it has

    model_types = SUPPORTED_MODEL_TYPES  # the HF model_type(s) this class serves

    @staticmethod
    def read_shape(config) -> Qwen3Config:
        """The model's shape from vLLM's HF config (one-line ValueError for what the strict model lacks)."""
        return Qwen3Config.from_hf({**config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}, "hf_config")

    def _attention_fn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The forward's attention: `_attention`, as one opaque custom op while torch.compile traces."""
        if torch.compiler.is_compiling():
            return attend(q, k, v, self.attn[layer].layer_name)
        return self._attention(layer, q, k, v)

    def _attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Paged attention over vLLM's KV cache of `layer` (the new tokens' k, v written first), into `out` [T, H, d]
        where given (rows of no request zeroed), else a new tensor."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        meta, attn, kv_cache, slot_mapping = get_attention_context(self.attn[layer].layer_name)
        if meta is None:  # only in vLLM's warm-up / profiling runs
            return torch.zeros_like(q) if out is None else out.zero_()
        n = meta.num_actual_tokens  # a Python int (padded count in a CUDA-graph batch)
        backend = attn.get_attn_backend().get_name()
        k_cache, v_cache = kv_cache_views(kv_cache, backend, self.shape.head_dim)
        slots = meta.slot_mapping if slot_mapping is None else slot_mapping
        if backend == "FLASH_ATTN" and self._flash_writer is not None:
            write_kv_flash(self._flash_writer, attn, k[:n], v[:n], k_cache, v_cache, slots[:n])
        else:
            write_kv(k[:n], v[:n], k_cache, v_cache, slots[:n])
        if out is None:
            if n == q.shape[0]:  # every row is the metadata's (no zero-fill and copy: two launches less per layer)
                return paged_attention(q, k_cache, v_cache, meta, self.model.scale)
            out = torch.zeros_like(q)
        elif n < out.shape[0]:
            out[n:] = 0
        out[:n] = paged_attention(q[:n], k_cache, v_cache, meta, self.model.scale)
        return out

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, self._attention_fn, inputs_embeds)

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
        self._warm_up_triton()
        self._refill_rope_tables()
        return loaded

    def _refill_rope_tables(self) -> None:
        """RoPE's cached angle tables written again with every weight load: they were allocated in the engine's
        first forward, inside vLLM's weights pool, whose content sleep level 2 drops (the weights come back through
        this method; the tables would not)."""
        if uses_triton(self.model.norm.weight.device):
            from rl_kernel.backends.triton.rope import refill_angle_tables

            refill_angle_tables()

    def _warm_up_triton(self) -> None:
        """Once, after the first load, where the strict ops run Triton kernels: compile every specialization
        serving can meet (`rl_kernel.integrations.vllm.warmup`), before vLLM profiles memory and captures graphs."""
        device = self.model.norm.weight.device
        if self.warmed_up is not None or not uses_triton(device):
            return
        self.warmed_up = warm_up(
            self.model, paged_attention=paged_attention, kv_cache_views=kv_cache_views, device=device, **self._warm_up
        )
        torch.cuda.empty_cache()  # the warm-up's activations are not the engine's (vLLM sizes the KV cache next)
