"""Strict attention gives a query the same bits whatever the layout: alone or packed with other
sequences, packed or padded, full prefill or decode or chunked prefill at any boundary (mixed in one
continuous batch), paged KV with any page size and any block-table order, 1 or 2 threads.

Raw bits of every output element are compared. Native twins: packing and page size/order hold
natively by construction of rl_kernel's native form (it runs SDPA once per sequence on the gathered,
contiguous keys: the same call on the same values, on any CPU), asserted as such. Padding,
prefill vs decode vs chunked and thread count have no native twin here: whether SDPA's CPU kernel
keeps a query's bits across those shapes depends on its blocking, and no input makes it differ on every
CPU (the model-level twins in tests/vllm and tests/megatron assert that native breaks the property).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_kernel as rk
from rl_kernel.backends.torch.attention import CHUNK, SPLIT_CHUNKS
from rl_kernel.bits import max_abs_diff, same_bits
from rl_kernel.selftest.matrix import cu_seqlens, paged_cache, paged_step, qkv

SETTINGS = settings(max_examples=5, deadline=None, database=None)
SCALE = 0.2
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _varlen(q, k, v, lens):
    return rk.attention_varlen(q, k, v, cu_seqlens(lens, "cpu"), SCALE)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert same_bits(a, b), f"{what}: max |diff| {max_abs_diff(a, b)}"


# --- packing: a sequence alone vs packed with others ----------------------------------------------------------


def _alone_and_packed(lens: list[int], order: list[int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs = [qkv(g, n, dtype, "cpu") for n in lens]
    alone = [_varlen(*s, [n]) for s, n in zip(seqs, lens)]
    packed = _varlen(*(torch.cat([seqs[i][j] for i in order]) for j in range(3)), [lens[i] for i in order])
    return list(zip([alone[i] for i in order], packed.split([lens[i] for i in order])))


@SETTINGS
@given(lens=st.lists(st.integers(1, 140), min_size=1, max_size=4), data=st.data(), dtype=DTYPES)
def test_packing_strict(lens, data, dtype):
    order = data.draw(st.permutations(range(len(lens))), label="order")
    for a, b in _alone_and_packed(lens, order, dtype, seed=len(lens)):
        _assert_same(a, b, f"lens {lens} order {order}")


def test_packing_native_holds_by_construction():
    """Native holds on this axis on any CPU: rl_kernel's native varlen runs SDPA on each sequence
    separately, the same call alone or packed."""
    with rk.mode("native"):
        pairs = _alone_and_packed([37, 130, 5, 70], [2, 0, 3, 1], torch.float32, seed=0)
    assert all(same_bits(a, b) for a, b in pairs)


# --- padding: packed vs right-padded to a common length -------------------------------------------------------


def _packed_and_padded(lens: list[int], width: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (t.view(len(lens), width, *t.shape[1:]) for t in qkv(g, len(lens) * width, dtype, "cpu"))
    padded = _varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), [width] * len(lens)).view(q.shape)
    packed = _varlen(*(torch.cat([t[b, :n] for b, n in enumerate(lens)]) for t in (q, k, v)), lens)
    return packed, torch.cat([padded[b, :n] for b, n in enumerate(lens)])


@SETTINGS
@given(lens=st.lists(st.integers(1, 100), min_size=1, max_size=3), extra=st.integers(0, 70), dtype=DTYPES)
def test_padding_strict(lens, extra, dtype):
    """Padding tokens (garbage) after each sequence: causal queries before them must not change."""
    _assert_same(*_packed_and_padded(lens, max(lens) + extra, dtype, seed=extra), f"lens {lens} +{extra}")


# --- prefill vs decode vs chunked prefill (one continuous batch) --------------------------------------------


def _prefill_vs_steps(lens: list[int], cuts: list[int], decode_tail: int, page: int, dtype, seed: int):
    """Reference: full causal prefill of every sequence. Steps: sequence 0 prefilled in chunks ending at
    `cuts` while the other sequences decode one token each in the same paged_attention call; then
    sequence 0 decodes its last `decode_tail` tokens alone."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(g, sum(lens), dtype, "cpu")
    ref = _varlen(q, k, v, lens).split(lens)
    k_cache, v_cache, table = paged_cache(k, v, lens, page, g)
    qs = q.split(lens)
    bounds = [0, *sorted(set(cuts)), lens[0] - decode_tail]
    pairs = []
    for a, e in zip(bounds[:-1], bounds[1:]):
        if e <= a:
            continue
        others = [(s, j, j + 1) for s in range(1, len(lens)) for j in [int(torch.randint(lens[s], (1,), generator=g))]]
        out = paged_step(qs, k_cache, v_cache, table, SCALE, [(0, a, e), *others]).split([e - a] + [1] * len(others))
        pairs += [(ref[0][a:e], out[0])] + [(ref[s][j : j + 1], o) for (s, j, _), o in zip(others, out[1:])]
    for j in range(lens[0] - decode_tail, lens[0]):
        pairs.append((ref[0][j : j + 1], paged_step(qs, k_cache, v_cache, table, SCALE, [(0, j, j + 1)])))
    return pairs


@SETTINGS
@given(data=st.data(), dtype=DTYPES, page=st.sampled_from([1, 3, 8, 16, 64]))
def test_prefill_decode_chunked_strict(data, dtype, page):
    lens = data.draw(st.lists(st.integers(1, 150), min_size=1, max_size=3), label="lens")
    tail = data.draw(st.integers(0, min(4, lens[0])), label="decode tail")
    cuts = data.draw(st.lists(st.integers(1, max(1, lens[0] - tail)), max_size=4), label="chunk ends")
    for i, (a, b) in enumerate(_prefill_vs_steps(lens, cuts, tail, page, dtype, seed=page)):
        _assert_same(a, b, f"pair {i}: lens {lens} cuts {cuts} tail {tail} page {page}")


def test_decode_vs_chunk_across_split_boundary():
    """Past SPLIT_CHUNKS * CHUNK keys the contract merges whole splits: decode steps and one chunked-prefill
    step that straddle that boundary agree bit for bit (checked against each other; a full prefill of this
    length is too slow for the unit suite)."""
    g = torch.Generator().manual_seed(0)
    n, first = SPLIT_CHUNKS * CHUNK + 40, SPLIT_CHUNKS * CHUNK - 3
    q, k, v = qkv(g, n, torch.float32, "cpu", heads=2, kv_heads=1, dim=16)
    k_cache, v_cache, table = paged_cache(k, v, [n], 16, g)
    chunk = paged_step([q], k_cache, v_cache, table, SCALE, [(0, first, first + 6)])
    for j in range(first, first + 6):
        _assert_same(
            chunk[j - first : j - first + 1],
            paged_step([q], k_cache, v_cache, table, SCALE, [(0, j, j + 1)]),
            f"position {j}",
        )


# --- page size and block-table order ----------------------------------------------------------------------------


def _varlen_vs_paged(lens: list[int], page: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(g, sum(lens), dtype, "cpu")
    k_cache, v_cache, table = paged_cache(k, v, lens, page, g)  # blocks shuffled across sequences
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    paged = rk.paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens(lens, "cpu"), SCALE)
    return _varlen(q, k, v, lens), paged


@SETTINGS
@given(
    lens=st.lists(st.integers(1, 140), min_size=1, max_size=3),
    dtype=DTYPES,
    page=st.one_of(st.sampled_from([1, 3, 8, 16, 64]), st.integers(1, 100)),
)
def test_page_size_and_block_order_strict(lens, dtype, page):
    _assert_same(*_varlen_vs_paged(lens, page, dtype, seed=page), f"lens {lens} page {page}")


@pytest.mark.parametrize("page", [1, 3, 16, 64])
def test_page_size_and_block_order_native_holds_by_construction(page):
    """Native holds on this axis on any CPU: rl_kernel's native paged form gathers the pages into the
    contiguous sequence before SDPA, so page size and block order cannot change what SDPA sees."""
    with rk.mode("native"):
        assert same_bits(*_varlen_vs_paged([70, 33, 100], page, torch.float32, seed=0))


# --- threads -------------------------------------------------------------------------------------------------------


def _threads(dtype):
    g = torch.Generator().manual_seed(0)
    lens = [100, 30]
    q, k, v = qkv(g, sum(lens), dtype, "cpu")
    k_cache, v_cache, table = paged_cache(k, v, lens, 8, g)

    def run():
        return [
            _varlen(q, k, v, lens),
            paged_step(list(q.split(lens)), k_cache, v_cache, table, SCALE, [(0, 60, 100), (1, 29, 30)]),
        ]

    torch.set_num_threads(1)
    one = run()
    torch.set_num_threads(2)  # restored by the conftest fixture
    return list(zip(one, run()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_strict(dtype):
    for a, b in _threads(dtype):
        _assert_same(a, b, "1 vs 2 threads")


def test_native_paged_decode_batch_equals_one_sequence_at_a_time():
    """The native paged form's batched decode path (one SDPA call, keys past each length masked) computes what its
    per-sequence path computes (native: no bit promise, so within fp32 rounding)."""
    from rl_kernel.ops.attention import _sdpa

    g = torch.Generator().manual_seed(3)
    lens = [70, 5, 129, 1]
    q, k, v = qkv(g, sum(lens), torch.float32, "cpu", heads=8)
    k_cache, v_cache, table = paged_cache(k, v, lens, 16, g)
    last = torch.tensor(lens).cumsum(0) - 1
    with rk.mode("native"):
        batched = rk.paged_attention(
            q[last], k_cache, v_cache, table, torch.tensor(lens), torch.arange(len(lens) + 1, dtype=torch.int32), SCALE
        )
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    ref = torch.cat([_sdpa(q[e - 1 : e], k[a:e], v[a:e], SCALE, e - a - 1) for a, e in zip(starts[:-1], starts[1:])])
    assert batched.shape == ref.shape and float((batched - ref).abs().max()) < 1e-5
