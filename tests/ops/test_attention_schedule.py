"""The Triton attention's schedule choice (pure logic: shapes in, `split` or `fused` out). Both schedules give the
same bits (tests/gpu, and the interpreter checks of CPU CI); the choice only moves time."""

from __future__ import annotations

import pytest

from rl_kernel.backends.triton.attention import FUSED_WAVES, SPLIT_SCRATCH_BYTES, pick_schedule


def _decode_programs(batch: int, kv_heads: int = 8, tokens_per_tile: int = 16) -> int:
    """Tiles x kv heads of a decode batch, as `_run` counts them (Qwen3-8B: 8 kv heads, 64-row tiles of G = 4)."""
    return (-(-batch // tokens_per_tile) + batch) * kv_heads


@pytest.mark.parametrize(
    "batch, schedule",
    [(1, "split"), (16, "split"), (32, "split"), (61, "split"), (62, "fused"), (64, "fused"), (256, "fused")],
)
def test_decode_batches_of_qwen3_8b_on_an_h200(batch, schedule):
    """132 SMs: the fused grid keeps 4 waves busy from about 62 sequences on (measured faster at 64 and up)."""
    assert pick_schedule(True, 8, 1 << 20, _decode_programs(batch), 132) == schedule


def test_split_needs_splits_room_and_a_paged_cache():
    few = FUSED_WAVES * 132 - 1
    assert pick_schedule(True, 8, 1 << 20, few, 132) == "split"
    assert pick_schedule(True, 1, 1 << 20, few, 132) == "fused"  # one split: nothing to split
    assert pick_schedule(True, 8, SPLIT_SCRATCH_BYTES + 1, few, 132) == "fused"  # partials too large
    assert pick_schedule(False, 8, 1 << 20, few, 132) == "fused"  # packed prefill has no split schedule
    assert pick_schedule(True, 8, 1 << 20, few + 1, 132) == "fused"
    assert pick_schedule(True, 8, 1 << 20, few + 1, 264) == "split"  # a GPU of more SMs splits further
