"""Triton JIT warm-up of the strict vLLM model: every kernel specialization serving can meet, compiled at load.

Triton compiles a kernel once per specialization key: its constexpr arguments and launch options, each pointer
argument's dtype and 16-byte alignment, and each integer argument's class (== 1, divisible by 16, other) unless
the kernel lists it in `do_not_specialize`. The strict kernels list every count that varies from batch to batch
(rows, sequences, their bit length, KV splits); what still varies is the constexprs each launcher picks from the
sizes (norm row tiles, GEMM tiles and schedule, the attention schedule). vLLM's own warm-up does not reach them
all: its profiling run skips attention (no metadata) and its CUDA-graph captures are decode batches, so a first
long prefill or mixed batch compiled `_attn_kernel` and `_rms_norm_kernel` during inference.

`warm_up` runs the strict forward once per token count of `warm_up_tokens` (both sides of every power of two up
to the scheduler's token budget, so both sides of every size threshold a launcher uses), with paged attention
over a one-block dummy cache in the layout and block-table width of the engine's, and the LM head's logits of
the sampled rows. tests/vllm/test_vllm_warmup.py checks on CPU, through Triton's own specialization function,
that every key the launchers produce for decode, prefill and mixed batches of the engine's limits is one the
warm-up produced.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import rl_kernel as rk
from rl_kernel import backends

TRITON_OPS = ("gemm", "rms_norm", "silu_and_mul", "rope", "attention")  # the ops of the strict forward


def uses_triton(device: torch.device) -> bool:
    """Whether any op of the strict forward runs a Triton kernel on `device` (then it needs the warm-up)."""
    try:
        return any(backends.strict_backend(op, device) == "triton" for op in TRITON_OPS)
    except rk.StrictModeError:
        return False


def warm_up_limit(max_tokens: int, max_seqs: int, max_model_len: int) -> int:
    """The most tokens one engine step can carry: the token budget, or fewer when `max_seqs` sequences of
    `max_model_len` tokens cannot fill it (e.g. a budget of 8192 beside 8 sequences of 560)."""
    return min(max_tokens, max_seqs * max_model_len)


def warm_up_tokens(max_tokens: int) -> list[int]:
    """Token counts of the warm-up forwards: 1, 2, 3, 2^k and 2^k + 1 up to `max_tokens`, and `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    counts = {c for c in (1, 2, 3) if c <= max_tokens} | {max_tokens}
    k = 1
    while (1 << k) <= max_tokens:
        counts |= {1 << k, min((1 << k) + 1, max_tokens)}
        k += 1
    return sorted(counts)


def dummy_batch(tokens: int, max_seqs: int, max_len: int, width: int, device: torch.device) -> SimpleNamespace:
    """Attention metadata of `tokens` new tokens in min(tokens, max_seqs) sequences, each starting at position 0
    and at most `max_len` long (the engine's max_model_len: the block table of `width` entries reaches no
    further). Every sequence takes one token, the last ones take the rest, up to `max_len` each (decode-like when
    tokens <= max_seqs, prefills beside single tokens otherwise); block table [seqs, width] of zeros (every
    position reads block 0)."""
    seqs = min(tokens, max_seqs)
    if tokens > seqs * max_len:
        raise ValueError(f"{tokens} warm-up tokens do not fit {seqs} sequences of at most {max_len} tokens")
    q_lens = torch.ones(seqs, dtype=torch.int32)
    extra, i = tokens - seqs, seqs - 1
    while extra:
        added = min(extra, max_len - 1)
        q_lens[i] += added
        extra -= added
        i -= 1
    query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    return SimpleNamespace(
        query_start_loc=query_start_loc.to(device),
        seq_lens=q_lens.to(device),
        block_table=torch.zeros(seqs, width, dtype=torch.int32, device=device),
    )


@torch.no_grad()  # not inference_mode: the RoPE table cache reads tensor versions
def warm_up(
    model,
    *,
    paged_attention,
    kv_cache_views,
    max_tokens: int,
    max_seqs: int,
    block_size: int,
    max_model_len: int,
    device: torch.device,
    backend: str = "FLASH_ATTN",
) -> list[int]:
    """Run `model` (`rl_kernel.models.layers.Qwen3Model`) once per count of `warm_up_tokens` up to
    `warm_up_limit(max_tokens, max_seqs, max_model_len)` with
    the serving model's `paged_attention` over a one-block cache of `backend`'s layout (`kv_cache_views`;
    block_size, cdiv(max_model_len, block_size) table entries per sequence) and the logits of the last
    min(tokens, max_seqs) rows. Values are meaningless (ids 0, no KV written); only the launches matter.
    Returns the token counts run."""
    shape, d = model.shape, model.config.head_dim
    dtype = model.norm.weight.dtype
    kv_cache = torch.zeros(1, block_size, shape.kv_heads, 2 * d, dtype=dtype, device=device).transpose(1, 2)
    if backend == "CPU_ATTN":  # [blocks, kv heads, block_size, 2d] in that physical order
        kv_cache = torch.zeros(1, shape.kv_heads, block_size, 2 * d, dtype=dtype, device=device)
    k_cache, v_cache = kv_cache_views(kv_cache, backend, d)
    width = -(-max_model_len // block_size)
    counts = warm_up_tokens(warm_up_limit(max_tokens, max_seqs, max_model_len))
    for tokens in counts:
        meta = dummy_batch(tokens, max_seqs, max_model_len, width, device)
        ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        positions = torch.arange(tokens, device=device)

        def attn(layer: int, q, k, v, meta=meta):
            return paged_attention(q, k_cache, v_cache, meta, model.scale)

        hidden = model(ids, positions, attn)
        model.lm_head.logits(hidden[-min(tokens, max_seqs) :])
    return counts
