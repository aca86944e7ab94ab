"""The Triton kernels past 2^31 elements: every kernel addresses memory with 64-bit offsets wherever a product
of its sizes can pass 2^31 (docs/triton.md, "Addressing"). Each test runs one op on a tensor of more than 2^31
elements (Qwen3-8B shapes, one H200) and compares every element's bits with the same op on row blocks small
enough for 32-bit offsets (a row's bits depend on that row only: the contracts' row invariance, tested in
test_triton_kernels.py). Outputs land on memory filled with NaN first, so an unwritten element shows.

Peak device memory per test is given in its docstring (all under 25 GB); the whole file runs in about a minute
on an H200.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

import rl_kernel as rk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from rl_kernel.backends.torch import rope as torch_rope  # noqa: E402
from rl_kernel.backends.triton import activation, attention, gemm, logprob, norm, rope  # noqa: E402
from rl_kernel.bits import same_bits as same  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
INT32_LIMIT = 2**31


@pytest.fixture(autouse=True)
def _free_memory():
    """Start and leave each test with an empty caching allocator (the tensors here are tens of GB)."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def poison(gigabytes: float) -> None:
    """Fill that much fresh allocator memory with all-ones bits (NaN as bf16, fp16, fp32) and free it: the
    test's tensors are then carved out of it, so an element no kernel wrote stays NaN."""
    t = torch.full((int(gigabytes * 2**30) // 4,), -1, dtype=torch.int32, device=DEV)
    del t


def randn(*shape, dtype=BF16, std=1.0, gen=None) -> torch.Tensor:
    t = torch.randn(*shape, device=DEV, dtype=dtype, generator=gen)
    return t.mul_(std) if std != 1.0 else t


def assert_rows_match(got: torch.Tensor, reference: Callable[[int, int], torch.Tensor], block: int, what: str) -> None:
    """Every element of got [rows, ...] has the bits of reference(a, b) on each row block [a, b)."""
    for a in range(0, got.shape[0], block):
        b = min(got.shape[0], a + block)
        assert same(got[a:b], reference(a, b)), f"{what}: rows {a}:{b} differ from the op on those rows alone"


# ---- elementwise -------------------------------------------------------------------------------------


def test_silu_and_mul_past_2_31():
    """SwiGLU of Qwen3-8B's gate_up output [180_000, 24_576] bf16 (4.4 G elements in, 2.2 G out), forward and
    the backward kernel. Peak ~22 GB."""
    gen = torch.Generator(device=DEV).manual_seed(21)
    rows, two_i = 180_000, 24_576
    poison(24)
    x = randn(rows, two_i, std=4.0, gen=gen)
    y = activation.silu_and_mul(x)
    assert y.numel() > INT32_LIMIT and x.numel() > INT32_LIMIT
    assert_rows_match(y, lambda a, b: activation.silu_and_mul(x[a:b]), 16384, "silu_and_mul")
    del y
    g = randn(rows, two_i // 2, gen=gen)
    dx = activation.silu_and_mul_backward(x, g)
    assert_rows_match(dx, lambda a, b: activation.silu_and_mul_backward(x[a:b], g[a:b]), 16384, "silu_and_mul_backward")


def test_rms_norm_past_2_31():
    """RMSNorm of [540_000, 4096] bf16 (2.2 G elements), forward and the backward kernel's dx. Peak ~18 GB."""
    gen = torch.Generator(device=DEV).manual_seed(22)
    rows, d = 540_000, 4096
    poison(20)
    x, w = randn(rows, d, std=3.0, gen=gen), randn(d, gen=gen)
    y = norm.rms_norm(x, w, 1e-6)
    assert y.numel() > INT32_LIMIT
    assert_rows_match(y, lambda a, b: norm.rms_norm(x[a:b], w, 1e-6), 32768, "rms_norm")
    del y
    dy = randn(rows, d, gen=gen)
    dx, _ = norm.rms_norm_backward(x, w, dy, 1e-6)  # dw sums over rows per program: no per-row reference
    assert_rows_match(
        dx, lambda a, b: norm.rms_norm_backward(x[a:b], w, dy[a:b], 1e-6)[0], 32768, "rms_norm_backward dx"
    )


def test_rope_past_2_31():
    """RoPE of queries [530_000, 32, 128] bf16 (2.2 G elements), full and partial rotary dims. Peak ~10 GB."""
    gen = torch.Generator(device=DEV).manual_seed(23)
    t = 530_000
    poison(12)
    q = randn(t, 32, 128, gen=gen)
    pos = torch.randint(0, 40_000, (t,), device=DEV, generator=gen)
    for rotary_dim in (128, 64):
        cos, sin = torch_rope.cos_sin(pos, rotary_dim, 1e6)
        out = rope.rotate(q, cos, sin, rotary_dim)
        assert out.numel() > INT32_LIMIT
        assert same(rope.rotate_at(q, pos, 1e6, rotary_dim), out)  # cos/sin computed in the kernel
        assert_rows_match(
            out,
            lambda a, b, c=cos, s=sin, r=rotary_dim: rope.rotate(q[a:b], c[a:b], s[a:b], r),
            32768,
            f"rope rotary_dim {rotary_dim}",
        )
        del out
        gc.collect()


# ---- GEMM ---------------------------------------------------------------------------------------------


def test_gemm_output_past_2_31():
    """The Triton GEMM with output [90_000, 24_576] (2.2 G elements; Qwen3-8B's gate_up at 90k tokens): the fused
    schedule (bf16 out, one chain) and the split schedule of a 2-group row-parallel contract (fp32 partials
    [2, M, N], 4.4 G elements, and the tree kernel over M x N), each against the fused schedule on row blocks
    (the schedules compute the same IEEE operations). Peak ~24 GB."""
    gen = torch.Generator(device=DEV).manual_seed(24)
    m, n, k = 90_000, 24_576, 4096
    poison(26)
    x, w = randn(m, k, gen=gen), randn(n, k, std=0.02, gen=gen)
    out = gemm.linear(x, w, server="triton")
    assert out.numel() > INT32_LIMIT
    assert_rows_match(out, lambda a, b: gemm.linear(x[a:b], w, server="triton"), 8192, "gemm fused")
    del out
    gc.collect()
    out = gemm.linear(x, w, k_group=k // 2, schedule="split")
    assert_rows_match(
        out, lambda a, b: gemm.linear(x[a:b], w, k_group=k // 2, schedule="fused"), 8192, "gemm split, 2 groups"
    )


# ---- logprobs / log_softmax -----------------------------------------------------------------------------


def test_log_softmax_and_logprobs_past_2_31():
    """Qwen3-8B's LM head on 14_336 tokens: fp32 logits [14_336, 151_936] (2.18 G elements) by the Triton GEMM,
    the Triton log_softmax over them (its stats pass reads all of them), both against row blocks, and the
    targets' entries against the fused logprob forward on the same rows (the contracts' pairing). Mixed
    temperatures, padded vocab. Peak ~22 GB."""
    gen = torch.Generator(device=DEV).manual_seed(25)
    t, d, v, real = 14_336, 4096, 151_936, 151_669
    poison(24)
    h, w = randn(t, d, gen=gen), randn(v, d, std=0.02, gen=gen)
    tg = torch.randint(0, real, (t,), device=DEV, generator=gen)
    temps = torch.ones(t, device=DEV, dtype=torch.float64).index_fill_(0, torch.arange(3000, 9000, device=DEV), 0.7)
    logits = gemm.matmul_fp32(h, w, server="triton")
    assert logits.numel() > INT32_LIMIT
    assert_rows_match(logits, lambda a, b: gemm.matmul_fp32(h[a:b], w, server="triton"), 2048, "fp32 logits")
    full = logprob.full_log_softmax(logits, temps, 0, real)
    assert_rows_match(
        full, lambda a, b: logprob.full_log_softmax(logits[a:b], temps[a:b], 0, real), 1024, "log_softmax"
    )
    assert bool(torch.isinf(full[:, real:]).all())
    scored, _ = logprob.logprobs_and_lse(h, w, tg, temps, 0, real)
    assert same(full.gather(1, tg[:, None]).squeeze(1), scored), "log_softmax entries != logprobs at 14k tokens"


# ---- attention ------------------------------------------------------------------------------------------


def _write(k_cache, v_cache, k, v, table, lens, page):
    start = 0
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=DEV)
        slots = table[b, pos // page].long() * page + pos % page
        rk.write_kv_cache(k[start : start + n], v[start : start + n], k_cache, v_cache, slots)
        start += n


def test_paged_attention_blocks_past_2_31():
    """Paged attention over a KV cache of 132_000 blocks x 16 x 8 heads x 128 (2.16 G elements per k and v view,
    bf16, 4.3 GB each) whose sequences' blocks are the cache's last ones (block x block stride past 2^31):
    decode, chunked prefill and whole prefill, both schedules, against the same sequences in a small cache
    holding the same blocks, and whole prefill against packed varlen attention. Peak ~9 GB."""
    gen = torch.Generator(device=DEV).manual_seed(26)
    page, kv_heads, heads, d, num_blocks = 16, 8, 32, 128, 132_000
    lens = [3000, 1, 700, 4100, 65]
    blocks = [-(-n // page) for n in lens]
    used = sum(blocks)
    k_big = torch.empty(num_blocks, page, kv_heads, d, dtype=BF16, device=DEV)
    v_big = torch.empty_like(k_big)
    assert k_big.numel() > INT32_LIMIT and (num_blocks - used) * k_big.stride(0) > INT32_LIMIT
    k_small = randn(used + 3, page, kv_heads, d, gen=gen)
    v_small = randn(used + 3, page, kv_heads, d, gen=gen)
    local = torch.randperm(used, device=DEV, generator=gen).to(torch.int32)  # shuffled blocks
    table_small = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=DEV)
    first = 0
    for b, nb in enumerate(blocks):
        table_small[b, :nb] = local[first : first + nb]
        first += nb
    table_big = num_blocks - 1 - table_small  # the cache's last `used` blocks (padding entries: its last block)
    k = randn(sum(lens), kv_heads, d, gen=gen)
    v = randn(sum(lens), kv_heads, d, gen=gen)
    _write(k_small, v_small, k, v, table_small, lens, page)
    _write(k_big, v_big, k, v, table_big, lens, page)
    seq_lens = torch.tensor(lens, device=DEV)
    scale = d**-0.5
    for name, q_lens in (("decode", [1] * len(lens)), ("chunked prefill", [100, 1, 64, 300, 65]), ("prefill", lens)):
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        q = randn(sum(q_lens), heads, d, gen=gen)
        for schedule in ("fused", "split"):
            big = attention.paged_attention(q, k_big, v_big, table_big, seq_lens, qsl, scale, schedule=schedule)
            small = attention.paged_attention(q, k_small, v_small, table_small, seq_lens, qsl, scale, schedule=schedule)
            assert same(big, small), f"{name}, {schedule}: blocks past 2^31 elements changed bits"
        if name == "prefill":
            assert same(big, attention.varlen_attention(q, k, v, qsl, scale)), "paged prefill != packed"


def test_split_decode_partials_past_2_31():
    """Split-schedule decode of 64 sequences (32 / 8 heads x 128) with a block table 262_144 blocks wide: 8192
    splits, so the fp32 split partials [64 x 32 x 8192 x 132] hold 2.2 G floats (8.9 GB) and the last rows' are
    written past 2^31. Against the fused schedule (no partials) on the same table and the split schedule on the
    table cut to the used width. Peak ~10 GB."""
    gen = torch.Generator(device=DEV).manual_seed(27)
    page, kv_heads, heads, d, b, width = 16, 8, 32, 128, 64, 262_144
    lens = torch.randint(1, 3000, (b,), generator=torch.Generator().manual_seed(27)).tolist()
    blocks = [-(-n // page) for n in lens]
    used = sum(blocks)
    num_splits = width * page // (attention.CHUNK * attention.SPLIT_CHUNKS)
    assert b * heads * num_splits * attention._partial_floats(d) > INT32_LIMIT
    k_cache = randn(used + 3, page, kv_heads, d, gen=gen)
    v_cache = randn(used + 3, page, kv_heads, d, gen=gen)
    physical = torch.randperm(used, device=DEV, generator=gen).to(torch.int32)
    table = torch.zeros(b, width, dtype=torch.int32, device=DEV)
    first = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = physical[first : first + nb]
        first += nb
    q = randn(b, heads, d, gen=gen)
    seq_lens = torch.tensor(lens, device=DEV)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=DEV)
    scale = d**-0.5
    poison(11)
    wide = attention.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, scale, schedule="split")
    fused = attention.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, scale, schedule="fused")
    narrow = attention.paged_attention(
        q, k_cache, v_cache, table[:, : max(blocks)], seq_lens, qsl, scale, schedule="split"
    )
    assert same(wide, fused), "split partials past 2^31 floats changed bits"
    assert same(wide, narrow)
