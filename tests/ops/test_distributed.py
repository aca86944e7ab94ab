"""Sharding over real gloo ranks (torch.multiprocessing spawn, 127.0.0.1): vocab-parallel logprobs at
tp 1, 2 and 4 equal the unsharded result bit for bit; row_parallel_linear at tp 2 and 4 equals linear
(TP-invariance); all_reduce equals the rank-order pairwise tree on every rank, call after call; a K
shard that does not hold whole contract groups fails closed. Native twins show each property breaks.
The ranks' work is `rl_kernel.selftest.ranks.rank_outputs` (strict and native, same inputs)."""

from __future__ import annotations

import pytest
import torch

from rl_kernel.bits import max_abs_diff, same_bits
from rl_kernel.selftest.ranks import run_distributed, tree_in_rank_order

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks() -> dict[int, list[dict]]:
    return {world: run_distributed(world) for world in (1, 2, 4)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_logprobs_strict(ranks, world):
    for rank, out in enumerate(ranks[world]):
        full, sharded = out["strict"]["logprobs/full"], out["strict"]["logprobs/sharded"]
        assert same_bits(full, sharded), f"tp{world} rank {rank}: {max_abs_diff(full, sharded)}"
    # and the same bits across world sizes (every world computed the unsharded reference itself too)
    assert same_bits(ranks[1][0]["strict"]["logprobs/sharded"], ranks[world][-1]["strict"]["logprobs/sharded"])


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_logprobs_native_breaks(ranks, world):
    """Native (Megatron-style: max, sum of exp and target logit all-reduced in fp32) sums exp terms in
    another order than the unsharded log_softmax."""
    assert any(not same_bits(o["native"]["logprobs/full"], o["native"]["logprobs/sharded"]) for o in ranks[world])


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_linear_tp_invariant_strict(ranks, world):
    for rank, out in enumerate(ranks[world]):
        full, sharded = out["strict"]["row_parallel/full"], out["strict"]["row_parallel/sharded"]
        assert same_bits(full, sharded), f"tp{world} rank {rank}: {max_abs_diff(full, sharded)}"


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_linear_native_breaks(ranks, world):
    """Native rounds each rank's partial to bf16 and all-reduces in bf16."""
    assert all(
        not same_bits(o["native"]["row_parallel/full"], o["native"]["row_parallel/sharded"]) for o in ranks[world]
    )


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_rank_order_tree_strict(ranks, world):
    ref = tree_in_rank_order(ranks[world][0]["strict"]["all_reduce/parts"])
    for out in ranks[world]:
        assert same_bits(ref, out["strict"]["all_reduce/out"])
        assert same_bits(out["strict"]["all_reduce/out"], out["strict"]["all_reduce/again"])


@pytest.mark.parametrize(("world", "is_tree"), [(2, True), (4, False)])
def test_all_reduce_native(ranks, world, is_tree):
    """Native (gloo's own algorithm): at tp4 the sum is not the rank-order tree (another association);
    at tp2 it is, necessarily (a + b == b + a exactly). Every rank still gets the same bits."""
    outs = [o["native"] for o in ranks[world]]
    assert same_bits(tree_in_rank_order(outs[0]["all_reduce/parts"]), outs[0]["all_reduce/out"]) is is_tree
    assert all(same_bits(outs[0]["all_reduce/out"], o["all_reduce/out"]) for o in outs)


@pytest.mark.parametrize("world", [2, 4])
def test_misaligned_k_shard_fails_closed(ranks, world):
    """K = 12 is not a multiple of 8, so it is one contract group that no shard of 12/tp holds whole."""
    for out in ranks[world]:
        op, backend, reason = out["strict"]["misaligned_error"].split("|")
        assert (op, backend) == ("gemm", "torch")
        assert "whole contract groups" in reason and f"tp={world}" in reason


def test_world_one_group_is_the_unsharded_op(ranks):
    out = ranks[1][0]["strict"]
    assert same_bits(out["row_parallel/full"], out["row_parallel/sharded"])
    assert torch.isfinite(out["logprobs/full"]).all()


@pytest.mark.parametrize("world", [2, 4])
def test_device_gather_path_gives_the_bits_of_the_gloo_path(ranks, world):
    """The strict vLLM model's CUDA path (partials gathered by a device communicator registered for the group,
    then the same rank-order tree) equals the torch.distributed gloo path and the unsharded op, bit for bit."""
    for out in ranks[world]:
        strict = out["strict"]
        assert same_bits(strict["row_parallel/device_gather"], strict["row_parallel/sharded"])
        assert same_bits(strict["row_parallel/device_gather"], strict["row_parallel/full"])
        assert same_bits(strict["all_reduce/device_gather"], strict["all_reduce/out"])
        assert same_bits(strict["all_reduce/device_gather"], tree_in_rank_order(strict["all_reduce/parts"]))
    # native twin: the framework's all-reduce of bf16 partials does not give the unsharded bits
    assert all(
        not same_bits(o["native"]["row_parallel/device_gather"], o["native"]["row_parallel/full"]) for o in ranks[world]
    )


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("key", ["truncated", "entropy"])
def test_vocab_parallel_truncation_and_entropy_strict(ranks, world, key):
    """Top-k / top-p over a support gathered from the vocab ranks, and the entropy's int64 sum: the sharded
    values equal the unsharded ones in bits on every rank (logprobs and entropy)."""
    for rank, out in enumerate(ranks[world]):
        for suffix in ("", "_entropy"):
            full, sharded = out["strict"][f"{key}/full{suffix}"], out["strict"][f"{key}/sharded{suffix}"]
            assert same_bits(full, sharded), f"{key}{suffix} tp{world} rank {rank}: {max_abs_diff(full, sharded)}"
    kept = ranks[world][0]["strict"]["truncated/full"]
    assert bool(torch.isfinite(kept[::2]).all()) and not same_bits(kept, ranks[world][0]["strict"]["entropy/full"])
