"""The primitives every strict torch kernel is built from: accuracy, and the tree's subtree property."""

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_kernel.backends.torch import numerics as nm
from rl_kernel.bits import same_bits


def test_sqrt32_is_correctly_rounded():
    """numpy's fp32 sqrt is IEEE (correctly rounded); torch's CPU sqrt is not, sqrt32 must be."""
    g = torch.Generator().manual_seed(0)
    for scale in (1e-30, 1.0, 10.0, 1e30):
        x = torch.rand(500_000, generator=g) * scale
        assert np.array_equal(nm.sqrt32(x).numpy().view(np.int32), np.sqrt(x.numpy()).view(np.int32))
    edge = torch.tensor([0.0, -0.0, math.inf, 1e-45, 3.4e38, 1.0, 4.0])
    assert np.array_equal(nm.sqrt32(edge).numpy().view(np.int32), np.sqrt(edge.numpy()).view(np.int32))
    assert torch.isnan(nm.sqrt32(torch.tensor([-1.0, math.nan]))).all()


def test_transcendentals_accuracy():
    x = torch.linspace(-700, 700, 200_001, dtype=torch.float64)
    assert ((nm.exp64(x) - torch.exp(x)) / torch.exp(x)).abs().max() < 1e-15
    y = torch.rand(200_000, dtype=torch.float64) * 1e6 + 1e-3
    assert ((nm.log64(y) - torch.log(y)) / torch.log(y).abs().clamp_min(1e-3)).abs().max() < 1e-14
    z = torch.linspace(-2e5, 2e5, 200_001, dtype=torch.float64)
    sin, cos = nm.sincos64(z)
    assert (sin - torch.sin(z)).abs().max() < 1e-14 and (cos - torch.cos(z)).abs().max() < 1e-14
    special = nm.exp64(torch.tensor([-math.inf, math.inf, math.nan, 0.0], dtype=torch.float64))
    assert special[0] == 0 and special[1] == math.inf and math.isnan(special[2]) and special[3] == 1


@settings(max_examples=20, deadline=None, database=None)
@given(log_width=st.integers(1, 8), shards=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_tree_sum_aligned_shards_are_subtrees(log_width, shards, seed):
    """An aligned power-of-two run of the input is an exact subtree: summing shards first, then the
    shard sums by the same tree, gives the full tree's bits (what makes TP shards exact)."""
    width = 1 << log_width
    if shards > width:
        shards = width
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(seed))
    full = nm.tree_sum(x)
    parts = torch.stack([nm.tree_sum(p) for p in x.chunk(shards, dim=-1)], dim=-1)
    assert same_bits(nm.tree_sum(parts), full)
