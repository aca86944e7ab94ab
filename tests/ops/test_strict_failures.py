"""Strict mode fails closed: an op that cannot honour its contract raises StrictModeError naming the
op, the backend and the reason, and never falls back to a native kernel. Bad inputs get a ValueError
saying what was wrong."""

from __future__ import annotations

import pytest
import torch

import rl_kernel as rk
from rl_kernel import OP_BOUNDARY
from rl_kernel.backends.torch.logprob import MAX_VOCAB


def _calls(dtype: torch.dtype) -> dict[str, tuple[str, object]]:
    """op -> (contract op name, a call of it on CPU tensors of `dtype`)."""

    def t(*shape):
        return torch.ones(shape).to(dtype)

    cu = torch.tensor([0, 4], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [1, 3], [0, 2], [2, 3]])
    return {
        "linear": ("gemm", lambda: rk.linear(t(4, 16), t(8, 16))),
        "linear_fp32": ("gemm", lambda: rk.linear_fp32(t(4, 16), t(8, 16))),
        "rms_norm": ("rms_norm", lambda: rk.rms_norm(t(4, 16), t(16), 1e-6)),
        "rms_norm_residual": ("rms_norm", lambda: rk.rms_norm(t(4, 16), t(16), 1e-6, t(4, 16))),
        "silu_and_mul": ("silu_and_mul", lambda: rk.silu_and_mul(t(4, 16))),
        "rope": ("rope", lambda: rk.rope(t(4, 2, 8), torch.arange(4), 1e4)),
        "attention_varlen": ("attention", lambda: rk.attention_varlen(t(4, 2, 8), t(4, 1, 8), t(4, 1, 8), cu, 0.3)),
        "paged_attention": (
            "attention",
            lambda: rk.paged_attention(
                t(4, 2, 8), t(2, 4, 1, 8), t(2, 4, 1, 8), torch.tensor([[0]]), torch.tensor([4]), cu, 0.3
            ),
        ),
        "logprobs": ("logprobs", lambda: rk.logprobs(t(4, 16), t(8, 16), torch.tensor([0, 1, 2, 3]))),
        "moe_route": ("moe_router", lambda: rk.moe_route(t(4, 16), t(4, 16), 2)),
        "moe_experts": ("moe_experts", lambda: rk.moe_experts(t(4, 16), ids, t(4, 8, 16), t(4, 16, 4))),
        "moe_combine": ("moe_combine", lambda: rk.moe_combine(t(4, 2, 16), t(4, 2), ids, torch.float32)),
    }


@pytest.mark.parametrize("name", sorted(_calls(torch.float32)))
def test_pinned_triton_backend_on_cpu_tensors(name):
    op, call = _calls(torch.float32)[name]
    rk.set_backend("triton")
    with rk.evidence.recording() as ran, pytest.raises(rk.StrictModeError) as err:
        call()
    assert (err.value.op, err.value.backend) == (op, "triton")
    assert "cpu" in err.value.reason and "CUDA" in err.value.reason
    assert rk.evidence.native_ops(ran) == []  # it did not fall back to a native kernel


@pytest.mark.parametrize("name", sorted(_calls(torch.int32)))
def test_integer_inputs(name):
    op, call = _calls(torch.int32)[name]
    with pytest.raises(rk.StrictModeError) as err:
        call()
    assert (err.value.op, err.value.backend) == (op, "torch")
    assert "torch.int32" in err.value.reason and "outside the contract" in err.value.reason
    assert f"'{op}'" in str(err.value) and "torch" in str(err.value)


def test_native_mode_does_not_consult_the_strict_backend():
    rk.set_backend("triton")
    with rk.mode("native"), rk.evidence.recording() as ran:
        rk.linear(torch.ones(2, 8), torch.ones(3, 8))
    assert [(r["op"], r["mode"]) for r in ran] == [("gemm", "native")]


def test_vocab_beyond_the_fixed_point_range():
    weight = torch.zeros(MAX_VOCAB + 1, 1)
    with pytest.raises(rk.StrictModeError) as err:
        rk.logprobs(torch.ones(1, 1), weight, torch.tensor([0]))
    assert err.value.op == "logprobs" and "int64 fixed-point sum could overflow" in err.value.reason


def test_log_softmax_needs_fp32_logits():
    with pytest.raises(rk.StrictModeError, match="linear_fp32"):
        rk.log_softmax(torch.ones(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize(("targets", "match"), [([0, 10], r"\[0, 10\)"), ([-1, 0], r"\[-1, 0\]")])
def test_targets_outside_the_real_vocab(targets, match):
    with pytest.raises(ValueError, match=match):
        rk.logprobs(torch.ones(2, 4), torch.ones(12, 4), torch.tensor(targets), vocab_size=10)


@pytest.mark.parametrize("temperature", [0.0, -1.0, torch.tensor([1.0, 0.0])])
def test_temperature_must_be_positive(temperature):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rk.logprobs(torch.ones(2, 4), torch.ones(8, 4), torch.tensor([0, 1]), temperature)


def test_temperature_shape():
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        rk.logprobs(torch.ones(2, 4), torch.ones(8, 4), torch.tensor([0, 1]), torch.ones(3))


def test_vocab_size_beyond_the_lm_head():
    with pytest.raises(ValueError, match="exceeds the LM head's 8 rows"):
        rk.logprobs(torch.ones(2, 4), torch.ones(8, 4), torch.tensor([0, 1]), vocab_size=9)


def test_kv_heads_must_divide_query_heads():
    q, kv = torch.ones(4, 3, 8), torch.ones(4, 2, 8)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
        rk.attention_varlen(q, kv, kv, torch.tensor([0, 4]), 0.3)


def test_unknown_mode_boundary_backend():
    with pytest.raises(ValueError, match="unknown rl_kernel mode"):
        rk.set_mode("fast")
    with pytest.raises(ValueError, match="unknown rl_kernel boundary"):
        rk.set_mode("strict", "softmax")
    with pytest.raises(ValueError, match="unknown rl_kernel backend"):
        rk.set_backend("cuda")


def test_strict_run_records_only_strict_contracts():
    """Evidence of a strict forward: every op under its registered contract, no native record."""
    contracts = {c.id: c.fingerprint for c in rk.contracts.all_contracts().values()}
    with rk.evidence.recording() as ran:
        for _, call in _calls(torch.float32).values():
            call()
    assert ran and rk.evidence.native_ops(ran) == []
    assert all(contracts[r["contract_id"]] == r["fingerprint"] for r in ran)
    assert {r["op"] for r in ran} == {
        "gemm",
        "rms_norm",
        "silu_and_mul",
        "rope",
        "attention",
        "logprobs",
        "moe_router",
        "moe_experts",
        "moe_combine",
    }


def test_op_boundary_names_the_boundary_each_op_obeys():
    """`rl_kernel.OP_BOUNDARY` (the map vime's contract gate reads) covers every op with a contract, and
    setting an op's boundary native is what makes that op run natively."""
    assert {c.op for c in rk.contracts.all_contracts().values()} <= set(OP_BOUNDARY)
    assert set(OP_BOUNDARY.values()) <= set(rk.BOUNDARIES)
    for name, (op, call) in _calls(torch.float32).items():
        with rk.mode("native", OP_BOUNDARY[op]), rk.evidence.recording() as ran:
            call()
        assert {r["op"] for r in ran if r["mode"] == "native"} == {op}, (name, ran)
