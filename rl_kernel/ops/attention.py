"""Attention boundary: causal GQA attention for packed varlen prefill and over a paged KV cache.

Strict contract (torch backend): see `rl_kernel.backends.torch.attention`. Scores q.k in fp32
(head dim in blocks of 64, pairwise tree), times `scale` in fp32; keys in chunks of 64 positions
counted from position 0 of the sequence, masked beyond the query's position; per chunk an fp32
(max, sum exp, sum exp*v) partial with rl_kernel's exp; partials merged left to right inside KV
splits of 1024 keys and the splits left to right; output o / l rounded once to q's dtype. The
result for a query depends only on its sequence's keys at positions <= its own, so packed prefill,
paged decode, chunked prefill, any page size and any block-table order give the same bits.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from rl_kernel.backends.torch import attention as torch_attention
from rl_kernel.ops import library
from rl_kernel.ops.spec import OpSpec


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int) -> torch.Tensor:
    """PyTorch SDPA for one sequence: q [Lq, H, d] at positions q_offset.., k, v [Lk, Hkv, d]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q_pos = q_offset + torch.arange(q.shape[0], device=q.device)
    mask = torch.arange(k.shape[0], device=q.device) <= q_pos.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def native_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """`attention_varlen` by PyTorch SDPA, one sequence at a time (the framework form)."""
    cu = cu_seqlens.tolist()
    return torch.cat([_sdpa(q[a:b], k[a:b], v[a:b], scale, 0) for a, b in zip(cu[:-1], cu[1:])])


def _sdpa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One batched SDPA call for a decode batch: q [B, H, d], the one query of each sequence, at its last
    position; every sequence's blocks gathered to the table's width, keys past its length masked."""
    blocks = block_table.to(torch.int64).clamp(0, k_cache.shape[0] - 1)  # entries past a sequence: masked anyway
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # [B, Hkv, blocks * block_size, d]
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    live = torch.arange(k.shape[2], device=q.device) < seq_lens.to(q.device).unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=live[:, None, None], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def native_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention` by PyTorch SDPA over gathered blocks (the framework form): a decode batch (one query per
    sequence) in one batched call, other layouts one sequence at a time."""
    b = seq_lens.numel()
    if q.shape[0] == b and torch.equal(query_start_loc.to(torch.int64).cpu(), torch.arange(b + 1)):
        return _sdpa_decode(q, k_cache, v_cache, block_table, seq_lens, scale)
    block_size = k_cache.shape[1]
    outs = []
    qsl = query_start_loc.tolist()
    for b, (a, e) in enumerate(zip(qsl[:-1], qsl[1:])):
        n = int(seq_lens[b])
        blocks = block_table[b, : -(-n // block_size)].to(torch.int64)
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n]
        outs.append(_sdpa(q[a:e], k, v, scale, n - (e - a)))
    return torch.cat(outs)


ATTENTION = OpSpec(
    "attention",
    "attention",
    __name__,
    native=native_varlen,
    kernels={"torch": "rl_kernel.backends.torch.attention", "triton": "rl_kernel.backends.triton.attention"},
)
_DEPENDENCY = (
    "out[t, h] depends on q[t, h] and k, v of its sequence at positions <= pos(t), kv head h // (H / Hkv), and scale"
)
ATTENTION.contract(
    "torch",
    1,
    input_dependency=_DEPENDENCY,
    partition=f"keys in chunks of {torch_attention.CHUNK} positions from position 0 (masked past the "
    f"query); KV splits of {torch_attention.SPLIT_CHUNKS} chunks; head dim in blocks of 64",
    merge_order="chunk partials (m, l, o) left to right within a split, splits left to right; "
    "sums inside a chunk by pairwise tree",
    precision="fp32 scores, max, exp, l and o; masked keys contribute exactly 0 (value zeroed)",
    rounding="o / l rounded once to q's dtype",
    primitives="rl_kernel exp64 rounded to fp32; IEEE fp32 mul, add, div, max",
    params=(("chunk", torch_attention.CHUNK), ("split_chunks", torch_attention.SPLIT_CHUNKS)),
)
ATTENTION.contract(
    "triton",
    1,
    input_dependency=_DEPENDENCY,
    partition="rows: a tile of (tokens) x (G heads of one kv head), its size moving no bit; keys in chunks of "
    "64 positions from position 0, masked past the query; KV splits of 8 chunks (512 keys)",
    merge_order="online softmax chunk by chunk inside a split from an empty state; split partials merged "
    "left to right; chunks and splits with no key for a row leave its state exactly unchanged",
    precision="q.k and p.v on tensor cores with fp32 accumulation (p rounded to v's dtype); fp32 m, l, o",
    rounding="o / l (IEEE div) rounded once to q's dtype",
    primitives="hardware ex2.approx.f32 on (s - m) with s = q.k * fp32(scale * log2 e); IEEE fp32 mul, add, "
    "max; no FMA (fp fusion off)",
    params=(("chunk", 64), ("split_chunks", 8)),
)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(contract, kernel module) of a strict attention call; raises on a dtype or a head count outside it."""
    contract, kernels = ATTENTION.strict(q.device, q, k, v)
    if q.shape[1] % k.shape[-2]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[-2]} kv heads")
    return contract, kernels


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences (positions 0..len-1 each).

    q [T, H, d], k and v [T, Hkv, d] with H a multiple of Hkv; cu_seqlens [B+1] int, cumulative
    sequence lengths starting at 0; `scale` multiplies q.k. Returns [T, H, d] in q's dtype.
    `max_seqlen`, the longest sequence (tokens), spares the backward a device-to-host read.
    """
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _attention_varlen_op(q, k, v, cu_seqlens, scale, max_seqlen)
    return ATTENTION(_StrictVarlenAttention.apply, q, k, v, cu_seqlens, scale, max_seqlen)


class _StrictVarlenAttention(torch.autograd.Function):
    """Forward under the contract. Backward (no bit contract): on CUDA with 16-bit inputs, PyTorch's
    FlashAttention-2 varlen backward (tensor cores, GQA, no score matrix in memory) from the forward's
    output and log-sum-exp, deterministic (no dQ atomics) unless RL_KERNEL_DETERMINISTIC_GRADS=0;
    elsewhere autograd through fp32 SDPA, one sequence at a time."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, max_seqlen=None):
        contract, kernels = _check(q, k, v)
        ctx.scale, ctx.max_seqlen = scale, max_seqlen
        ctx.flash = (
            contract.backend == "triton"
            and q.dtype in (torch.bfloat16, torch.float16)
            and any(ctx.needs_input_grad[:3])
        )
        if contract.backend == "triton":
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) if ctx.flash else None
            out = kernels.varlen_attention(q, k, v, cu_seqlens, scale, lse=lse)
        else:
            out = kernels.varlen_attention(q, k, v, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, cu_seqlens, *((out, lse) if ctx.flash else ()))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.flash:
            return (*_flash_backward(grad_out, *ctx.saved_tensors, ctx.scale, ctx.max_seqlen), None, None, None)
        q, k, v, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().to(torch.float32).requires_grad_() for t in (q, k, v)]
            out = native_varlen(*inputs, cu_seqlens, ctx.scale)
            grads = torch.autograd.grad(out, inputs, grad_out.to(torch.float32))
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), None, None, None


DETERMINISTIC_GRADS = os.environ.get("RL_KERNEL_DETERMINISTIC_GRADS", "1") != "0"


def _flash_backward(grad_out, q, k, v, cu_seqlens, out, lse, scale, max_seqlen=None):
    """dq, dk, dv of causal varlen attention by FlashAttention-2's backward, given out and lse [H, T]."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max()) if max_seqlen is None else max_seqlen
    unused = torch.empty(2, dtype=torch.int64, device=q.device)  # dropout RNG state: no dropout here
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(DETERMINISTIC_GRADS)  # warn-only would keep FA2's dQ atomics
    try:
        return torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, unused, unused, scale=scale
        )
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new queries over a paged KV cache (decode, chunked prefill, prefill).

    q [Tq, H, d]: the new tokens of B sequences, packed; query_start_loc [B+1] int delimits them.
    k_cache, v_cache [num_blocks, block_size, Hkv, d]; block_table [B, max_blocks] int maps logical
    block i of a sequence to a physical block; seq_lens [B] int is each sequence's context length
    including its new tokens, whose K/V must already be in the cache (`write_kv_cache`). Query j of
    sequence b sits at position seq_lens[b] - q_len[b] + j. Returns [Tq, H, d] in q's dtype.
    """
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _paged_attention_op(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    return ATTENTION(
        _strict_paged, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, native_form=native_paged
    )


def _strict_paged(q, k_cache, v_cache, *rest):
    return _check(q, k_cache, v_cache)[1].paged_attention(q, k_cache, v_cache, *rest)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [T, Hkv, d] at flat slots (block * block_size + offset) of the paged caches: a copy."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping.to(torch.int64)] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping.to(torch.int64)] = v.to(v_cache.dtype)


# ---- the op as one opaque node for torch.compile (rl_kernel.ops.library) ----


@torch.library.custom_op(f"{library.LIB}::attention_varlen", mutates_args=())
def _attention_varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, max_seqlen: int | None
) -> torch.Tensor:
    return attention_varlen(q, k, v, cu_seqlens, scale, max_seqlen).contiguous()


@_attention_varlen_op.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens, scale, max_seqlen):
    return library.like(q)


@torch.library.custom_op(f"{library.LIB}::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale).contiguous()


@_paged_attention_op.register_fake
def _paged_attention_fake(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale):
    return library.like(q)
