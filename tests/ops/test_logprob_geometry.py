"""The Triton logprob forward's geometry (pure logic, no device): how rows and vocab are cut into row chunks and
logits slices. No bit depends on it (tests/gpu compare geometries); what must hold is that the cuts cover
everything, align where they can, and keep the forward's state under its budget."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from rl_kernel.backends.triton import logprob  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 300_000), most=st.integers(1, 50_000), align=st.sampled_from([1, 64, 128, 256]))
def test_even_parts_cover_within_bound_and_align(total, most, align):
    part = logprob._even_parts(total, most, align)
    fewest = math.ceil(total / most)  # as few parts as the bound allows
    assert 1 <= part <= most
    assert math.ceil(total / part) == fewest
    if math.ceil(math.ceil(total / fewest) / align) * align <= most:  # an aligned part was possible: taken
        assert part % align == 0


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 65_536),
    vocab_tiles=st.integers(1, 4096),
    d=st.sampled_from([128, 1024, 4096]),
    fraction=st.sampled_from([4, 12, 64]),
)
def test_forward_geometry_keeps_the_state_under_its_budget(rows, vocab_tiles, d, fraction):
    vocab = vocab_tiles * logprob.VOCAB_TILE
    weight = torch.empty(vocab, d, dtype=torch.bfloat16, device="meta")
    n_tiles = vocab_tiles
    saved, logprob.STATE_FRACTION = logprob.STATE_FRACTION, fraction
    try:
        chunk, cols = logprob._forward_geometry(rows, weight, n_tiles)
        share = logprob._state_budget(weight) // logprob.FORWARD_PARTS
    finally:
        logprob.STATE_FRACTION = saved
    assert 1 <= chunk <= rows
    assert chunk == 1 or chunk * n_tiles * 12 <= share  # the row chunk's tile stats fit their share
    assert cols >= 1 and (cols % 256 == 0 or cols < 256 or math.ceil(vocab / cols) == 1)
    if share // (chunk * 4) >= 256:  # a slice of at least 256 columns fits: the slice keeps to its share
        assert chunk * min(cols, vocab) * 4 <= share


def test_forward_geometry_at_qwen3_8b():
    weight = torch.empty(151936, 4096, dtype=torch.bfloat16, device="meta")
    chunk, cols = logprob._forward_geometry(8192, weight, 151936 // logprob.VOCAB_TILE)
    assert (chunk, cols) == (1664, 7680)  # 5 chunks of whole 128-row tiles, 20 slices of whole 256 columns
