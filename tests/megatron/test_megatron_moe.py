"""Megatron-core with the Qwen3-MoE layer spec (tp 1, expert parallelism 1) on gloo: the strict trainer's
logprobs equal the reference's bit for bit and every (token, layer) routes to the same experts; the native twin
(Megatron's modules and the MoE ops' native forms) mismatches; HF -> Megatron -> HF is bit-exact for the expert
weights; one training step moves the router and the experts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_kernel.bits import bit_mismatches, same_bits

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_strict_moe_trainer_equals_reference_with_the_same_routes(moe_world1):
    r = moe_world1["tp1cp1"]
    assert sum(x.numel() for x in r["strict"]) == 384
    assert bit_mismatches(r["strict"], r["ref"]) == 0
    assert len(r["strict_routes"]) == 2 and r["strict_routes"][0].shape == (484, 2)
    assert all(torch.equal(a, b) for a, b in zip(r["strict_routes"], r["ref_routes"]))
    assert {op for op, _ in r["strict_evidence"]} >= {"moe_router", "moe_experts", "moe_combine"}
    assert {mode for _, mode in r["strict_evidence"]} == {"strict"}


def test_native_moe_trainer_twin_mismatches(moe_world1):
    r = moe_world1["tp1cp1"]
    assert bit_mismatches(r["native"], r["ref"]) > 0
    assert {mode for _, mode in r["native_evidence"]} == {"native"}


def test_expert_weights_round_trip_and_train(moe_world1, tiny_moe_path):
    r = moe_world1["tp1cp1"]
    stored = load_file(str(tiny_moe_path / "model.safetensors"))
    assert set(r["export"]) == set(stored)
    assert all(same_bits(r["export"][n], stored[n]) for n in stored)
    moved = [n for n in stored if not same_bits(r["train_model"][n], stored[n])]
    assert any(".mlp.gate.weight" in n for n in moved) and any(".mlp.experts." in n for n in moved)
    assert float(r["train_main_grad"]["model.layers.0.mlp.gate.weight"].abs().sum()) > 0
