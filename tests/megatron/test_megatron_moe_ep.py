"""Megatron's expert parallelism with the strict MoE layer on gloo (2 ranks, extended): `RKMoELayer` built under
`expert_model_parallel_size = 2` holds its E / 2 experts and, over Megatron's expert-parallel group, gives every
token the output and route bits of the one-rank block (`rk.moe`); its native twin (the framework's combine over
ranks) differs; MegatronPolicy refuses that parallel state in one line."""

from __future__ import annotations

import pytest
import torch

import rl_kernel as rk
from rl_kernel.bits import bit_mismatches, same_bits

pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.extended]

E, D, I, K = 8, 64, 32, 4
TOKENS = [40, 24]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, tiny_moe_path) -> tuple[dict, list[dict]]:
    from moe_ep_workers import spawn_ep

    g = torch.Generator().manual_seed(5)
    case = {
        "x": torch.randn(sum(TOKENS), D, generator=g).to(torch.bfloat16),
        "router": torch.randn(E, D, generator=g).to(torch.bfloat16),
        "gate_up": (torch.randn(E, 2 * I, D, generator=g) * 0.2).to(torch.bfloat16),
        "down": (torch.randn(E, D, I, generator=g) * 0.2).to(torch.bfloat16),
        "grad_out": torch.randn(sum(TOKENS), D, generator=g),
        "top_k": K,
        "tokens": TOKENS,
    }
    return case, spawn_ep(2, case, tiny_moe_path, tmp_path_factory.mktemp("moe_ep") / "out")


def test_rk_moe_layer_ep2_equals_ep1_bits(ep2):
    case, ranks = ep2
    args = (case["x"], case["router"], case["gate_up"], case["down"], K)
    with rk.mode("strict"):
        ref, ref_ids = rk.moe(*args)
    assert [r["ep"] for r in ranks] == [2, 2] and [r["ep_rank"] for r in ranks] == [0, 1]
    assert all(r["expert_shapes"] == [(E // 2, 2 * I, D), (E // 2, D, I)] for r in ranks)
    assert all(r["allreduce"] == [False, False] for r in ranks)
    out, ids = torch.cat([r["out"] for r in ranks]), torch.cat([r["ids"] for r in ranks])
    assert torch.equal(ids, ref_ids)
    assert same_bits(out, ref), f"{bit_mismatches(out, ref)} mismatching elements"
    # every rank's experts got gradients from both ranks' tokens
    assert all(float(r["grad_gate_up"].abs().sum()) > 0 for r in ranks)
    with rk.mode("native"):
        native_ref, _ = rk.moe(*args)
    native = torch.cat([r["native"] for r in ranks])
    assert not same_bits(native, native_ref)


def test_policy_refuses_expert_parallelism(ep2):
    _, ranks = ep2
    for r in ranks:
        assert r["policy_error"] is not None and "expert_model_parallel_size=2" in r["policy_error"]
