"""The strict vLLM model's attention function on CUDA, without vLLM (not on the GPU image): the FlashAttention
cache layout vLLM allocates (logical [blocks, kv_heads, block_size, 2d], physical LBNHC), a decode batch padded
as vLLM pads a CUDA-graph batch (a request with no token and seq_len 0, tokens past query_start_loc[-1] with slot
-1), captured in a CUDA graph with the Triton backend and replayed. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rl_kernel as rk
from rl_kernel.bits import same_bits
from rl_kernel.integrations.vllm.model import _paged_attention_compact, kv_cache_views, paged_attention, write_kv

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, D, BLOCK, BLOCKS = 32, 8, 128, 16, 96
LENS = [700, 33, 1]  # context lengths of the real requests, the new token included
GRAPH_TOKENS = 8  # the captured batch size: 3 real tokens, then padding


def _flash_cache(gen: torch.Generator) -> torch.Tensor:
    """A layer cache as vLLM hands it to FlashAttention: logical [blocks, Hkv, block, 2d] over LBNHC memory."""
    raw = torch.randn(BLOCKS, BLOCK, KV_HEADS, 2 * D, generator=gen, device="cuda").to(torch.bfloat16)
    return raw.permute(0, 2, 1, 3)


def _batch(gen: torch.Generator):
    """Metadata of 3 real decode requests and one padded request, blocks scattered, the table wider than needed."""
    perm = torch.randperm(BLOCKS - 1, generator=gen, device="cuda") + 1  # block 0: vLLM's null block
    need = [(n + BLOCK - 1) // BLOCK for n in LENS]
    table = torch.zeros(len(LENS) + 1, max(need) + 3, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n]
        start += n
    seq_lens = torch.tensor(LENS + [0], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32, device="cuda")
    last = torch.tensor(LENS, device="cuda") - 1
    slots = torch.full((GRAPH_TOKENS,), -1, dtype=torch.int64, device="cuda")
    slots[: len(LENS)] = table[torch.arange(len(LENS), device="cuda"), last // BLOCK].long() * BLOCK + last % BLOCK
    return SimpleNamespace(seq_lens=seq_lens, block_table=table, query_start_loc=qsl), slots


def _step(q, k, v, k_cache, v_cache, meta, slots):
    write_kv(k, v, k_cache, v_cache, slots)
    return paged_attention(q, k_cache, v_cache, meta, D**-0.5)


def _compact_reference(q, k_cache, v_cache, meta):
    """The model's compacting path (what the CPU layout runs) over the real requests and their rows only."""
    n = len(LENS)
    real = SimpleNamespace(
        seq_lens=meta.seq_lens[:n], block_table=meta.block_table[:n], query_start_loc=meta.query_start_loc[: n + 1]
    )
    return _paged_attention_compact(q[:n], k_cache, v_cache, real, D**-0.5)


def test_flash_layout_decode_captures_and_replays_bitwise():
    gen = torch.Generator(device="cuda").manual_seed(3)
    k_cache, v_cache = kv_cache_views(_flash_cache(gen), "FLASH_ATTN", D)
    meta, slots = _batch(gen)

    def new_inputs():
        return (
            torch.randn(GRAPH_TOKENS, HEADS, D, generator=gen, device="cuda").to(torch.bfloat16),
            *(
                torch.randn(GRAPH_TOKENS, KV_HEADS, D, generator=gen, device="cuda").to(torch.bfloat16)
                for _ in range(2)
            ),
        )

    static = [t.clone() for t in new_inputs()]
    with torch.no_grad(), rk.mode("strict"), rk.evidence.recording() as ran:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _step(*static, k_cache, v_cache, meta, slots)  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _step(*static, k_cache, v_cache, meta, slots)
        for _ in range(2):
            inputs = new_inputs()
            for dst, src in zip(static, inputs):
                dst.copy_(src)
            untouched = k_cache.clone(), v_cache.clone()
            graph.replay()
            torch.cuda.synchronize()
            n = len(LENS)
            written = slots[:n]
            for cache, before, new in ((k_cache, untouched[0], inputs[1]), (v_cache, untouched[1], inputs[2])):
                flat, flat_before = cache.reshape(-1, KV_HEADS, D), before.reshape(-1, KV_HEADS, D)
                assert same_bits(flat[written], new[:n]), "the replay did not write the new tokens' k/v"
                keep = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
                keep[written] = False
                assert same_bits(flat[keep], flat_before[keep]), "the replay wrote outside the new tokens' slots"
            assert torch.isfinite(static_out).all()
            assert same_bits(static_out[:n], _compact_reference(inputs[0], k_cache, v_cache, meta)), (
                "the captured in-place attention differs from the compacting call"
            )
            assert not static_out[n:].any(), "padding rows must be 0"
            assert same_bits(static_out, _step(*inputs, k_cache, v_cache, meta, slots)), "replay differs from eager"
    assert {r["backend"] for r in ran if r["op"] == "attention"} == {"triton"}

    # the twin: the bits do depend on the table (one block of request 0 pointed elsewhere)
    wrong = SimpleNamespace(**vars(meta))
    wrong.block_table = meta.block_table.clone()
    wrong.block_table[0, 5] = meta.block_table[1, 0]
    with torch.no_grad(), rk.mode("strict"):
        assert not same_bits(paged_attention(static[0], k_cache, v_cache, wrong, D**-0.5)[:1], static_out[:1])
