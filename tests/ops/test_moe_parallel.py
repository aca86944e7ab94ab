"""Expert parallelism (`rl_kernel.ops.moe_parallel`) over real gloo ranks on the CPU: a standing world of spawned
ranks (`rl_kernel.selftest.ep_world.EPWorld`) runs the sparse block with the experts split over 2 (CI) or 4
(extended) ranks, and the tokens of a one-rank case split over the ranks in any counts (zero too).

Strict: every token's output and expert ids at EP = 2 / 4 have the raw bits of `rk.moe` on one rank (hypothesis
over token counts per rank, top-k, dtype and inputs). Native twins: the framework's expert-parallel combine
(per-rank partial sums, summed across ranks) changes tokens' bits; the same partial sums in fp32 with one
rounding (the strict combine reassociated by rank) change them too, so the fixed slot order across ranks is
what gives the bits, not the fp32 accumulator alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_kernel as rk
from rl_kernel.bits import bit_mismatches, same_bits
from rl_kernel.ops.moe_parallel import check_expert_slices
from rl_kernel.selftest.ep_world import EPWorld, shares

E, D, I = 8, 64, 32
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _case(seed: int, tokens: int, dtype: torch.dtype, experts: int = E) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=g).to(dtype)
    router = torch.randn(experts, D, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * I, D, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, D, I, generator=g) * 0.2).to(dtype)
    return x, router, gate_up, down


def _ep(world: EPWorld, inputs, tokens: list[int], top_k: int, mode: str = "strict"):
    results = world.run(shares(*inputs, tokens, top_k, mode=mode))
    return torch.cat([r["out"] for r in results]), torch.cat([r["ids"] for r in results])


def _check_bits(world: EPWorld, seed: int, tokens: list[int], top_k: int, dtype: torch.dtype) -> None:
    inputs = _case(seed, sum(tokens), dtype)
    out1, ids1 = rk.moe(*inputs, top_k)
    out, ids = _ep(world, inputs, tokens, top_k)
    assert torch.equal(ids, ids1), f"EP{world.world} routes differ from EP1 (tokens {tokens})"
    assert same_bits(out, out1), f"EP{world.world} {dtype} k={top_k} tokens {tokens}: {bit_mismatches(out, out1)}"


def _native_twin(world: EPWorld) -> int:
    """Tokens whose native EP output bits differ from native EP1 (bf16, top-4: slots on several ranks)."""
    inputs = _case(7, 64, torch.bfloat16)
    with rk.mode("native"):
        out1, _ = rk.moe(*inputs, 4)
    out, _ = _ep(world, inputs, [40, 24] if world.world == 2 else [20, 4, 0, 40], 4, mode="native")
    return int((out.view(torch.int16) != out1.view(torch.int16)).any(-1).sum())


@pytest.fixture(scope="module")
def world2():
    with EPWorld(2) as world:
        yield world


@pytest.fixture(scope="module")
def world4():
    with EPWorld(4) as world:
        yield world


def _tokens(world: int):
    return st.lists(st.integers(0, 12), min_size=world, max_size=world).filter(lambda t: sum(t) > 0)


# ---- CI: EP = 2 ----------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=_tokens(2), top_k=st.integers(1, 4), dtype=st.sampled_from(DTYPES))
def test_ep2_forward_bits_equal_ep1(world2, seed, tokens, top_k, dtype):
    _check_bits(world2, seed, tokens, top_k, dtype)


@pytest.mark.slow
def test_ep2_native_combine_breaks(world2):
    """The framework's combine (partial sums per owning rank in bf16, summed across ranks) moves tokens' bits."""
    assert _native_twin(world2) > 0


# ---- extended: EP = 4, backward ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.extended
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=_tokens(4), top_k=st.integers(1, 8), dtype=st.sampled_from(DTYPES))
def test_ep4_forward_bits_equal_ep1(world4, seed, tokens, top_k, dtype):
    _check_bits(world4, seed, tokens, top_k, dtype)


@pytest.mark.slow
@pytest.mark.extended
def test_ep4_native_combine_breaks(world4):
    assert _native_twin(world4) > 0


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("ep", [2, 4])
def test_backward_through_dispatch_matches_ep1(world2, world4, ep):
    """Gradients (no bit contract) through the all-to-alls equal EP1's: x and each rank's experts here to
    fp32 rounding, the router's summed over ranks (the data-parallel all-reduce) to fp32 rounding."""
    world, tokens = (world2, [10, 14]) if ep == 2 else (world4, [3, 0, 12, 9])
    inputs = _case(3, sum(tokens), torch.float32)
    grad_out = torch.randn(sum(tokens), D, generator=torch.Generator().manual_seed(4))
    leaves = [t.clone().requires_grad_() for t in inputs]
    out, _ = rk.moe(*leaves, 4)
    (out * grad_out).sum().backward()
    ranks = world.run(shares(*inputs, tokens, 4, grad_out=grad_out))
    got = {
        "x": torch.cat([r["grad_x"] for r in ranks]),
        "router": sum(r["grad_router"] for r in ranks),
        "gate_up": torch.cat([r["grad_gate_up"] for r in ranks]),
        "down": torch.cat([r["grad_down"] for r in ranks]),
    }
    for name, leaf in zip(("x", "router", "gate_up", "down"), leaves, strict=True):
        torch.testing.assert_close(got[name], leaf.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ---- pure logic (no ranks) ---------------------------------------------------------------------------


def _rank_partials(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, world: int) -> torch.Tensor:
    """The strict combine reassociated by rank: fp32 partial sums of each owning rank's slots (ascending id), the
    partials summed in rank order in fp32 (the output dtype here: no rounding hides the association)."""
    owner = torch.div(ids, E // world, rounding_mode="floor")
    total = torch.zeros(y.shape[0], y.shape[-1])
    for r in range(world):
        part = torch.zeros_like(total)
        for j in range(ids.shape[1]):  # ids ascending: left to right is ascending expert id
            part = part + torch.where((owner[:, j] == r).unsqueeze(-1), weights[:, j, None] * y[:, j], 0.0)
        total = total + part
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_rank_partial_sums_twin_breaks(world):
    """Summing per-rank fp32 partials (one rounding, slots ascending within a rank) is not the one-rank combine:
    for top-4 a token's slots on two ranks sum as (a + b) + (c + d), not ((a + b) + c) + d."""
    x, router, gate_up, down = _case(11, 256, torch.float32)
    weights, ids = rk.moe_route(x, router, 4)
    y = rk.moe_experts(x, ids, gate_up, down)
    strict = rk.moe_combine(y, weights, ids, torch.float32)
    assert same_bits(_rank_partials(y, weights, ids, 1), strict)  # one rank: the helper is the contract
    assert not same_bits(_rank_partials(y, weights, ids, world), strict)


def test_expert_slices_must_cover_the_router():
    check_expert_slices(8, 4, 2)
    with pytest.raises(ValueError, match=r"router has 8 experts but 3 ranks hold 2 each.*divisible by ep"):
        check_expert_slices(8, 2, 3)
