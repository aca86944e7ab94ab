"""Strict GEMM on the torch backend: out[m, n] = sum_k x[m, k] * w[n, k] in a fixed order.

The K axis is cut into K_GROUPS equal groups (one group when K is not a multiple of K_GROUPS).
Inside a group, the products are summed in blocks of 64 (pairwise tree inside a block, blocks left
to right); the group sums are then combined by a balanced pairwise tree. A tensor-parallel rank
that holds K_GROUPS / tp whole groups therefore computes an exact subtree of the full sum, which
is what makes row-parallel layers TP-invariant.
"""

from __future__ import annotations

import torch

from rl_kernel.backends.torch.numerics import blocked_sum, tree_sum

K_GROUPS = 8
_TILE_ELEMENTS = 1 << 23  # products held at once per tile (32 MiB of fp32); does not change any bit


def group_size(k: int) -> int:
    """Size of one K group for a reduction of total length k."""
    return k // K_GROUPS if k % K_GROUPS == 0 else k


def group_sums(x: torch.Tensor, weight: torch.Tensor, k_group: int) -> torch.Tensor:
    """fp32 partial sums [M, N, K/k_group]: one per K group, each reduced in blocks of 64."""
    m, k = x.shape
    n = weight.shape[0]
    groups = k // k_group
    x32 = x.to(torch.float32).reshape(m, 1, groups, k_group)
    w32 = weight.to(torch.float32).reshape(1, n, groups, k_group)
    out = torch.empty(m, n, groups, dtype=torch.float32, device=x.device)
    rows = max(1, _TILE_ELEMENTS // max(1, n * k))
    cols = n if rows > 1 else max(1, _TILE_ELEMENTS // k)
    for r in range(0, m, rows):
        for c in range(0, n, cols):
            products = x32[r : r + rows] * w32[:, c : c + cols]  # exact for bf16 inputs
            out[r : r + rows, c : c + cols] = blocked_sum(products)
    return out


def matmul_fp32(x: torch.Tensor, weight: torch.Tensor, k_group: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T in fp32, unrounded, under the GEMM contract.

    `k_group` is the contract's group size for the *full* reduction; a tensor-parallel shard passes
    the full K's group size so that its groups line up with the unsharded ones.
    """
    k_group = group_size(x.shape[-1]) if k_group is None else k_group
    if x.shape[-1] % k_group:
        raise ValueError(f"K={x.shape[-1]} is not a whole number of contract groups of {k_group}")
    return tree_sum(group_sums(x, weight, k_group))
