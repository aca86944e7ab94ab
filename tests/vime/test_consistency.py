"""Consistency metrics (fp32 bit patterns on every token, worst token) and the comparability gate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rl_kernel as rk
from rl_kernel.bits import same_bits
from vime.engines import Sample, Scored
from vime.errors import ComparabilityError
from vime.loop.consistency import check_comparable, check_contracts, compare, rollout_tensor


def _next_up(x: torch.Tensor) -> torch.Tensor:
    """The fp32 neighbour one ulp away (bit pattern + 1)."""
    return (x.view(torch.int32) + 1).view(torch.float32)


def test_identical_bits_have_no_mismatch():
    a = [torch.randn(5), torch.randn(3)]
    r = compare(a, [t.clone() for t in a])
    assert (r.mismatch_count, r.max_abs_diff, r.mean_abs_diff, r.tokens, r.worst) == (0, 0.0, 0.0, 8, None)


def test_one_ulp_is_a_mismatch_and_the_worst_token_is_located():
    a = [-torch.rand(4) - 0.5, -torch.rand(6) - 0.5]
    b = [t.clone() for t in a]
    b[1][2] = _next_up(b[1][2:3])[0]  # 1 ulp
    b[1][4] = b[1][4] + 0.25  # the worst
    b[0][0] = _next_up(b[0][0:1])[0]
    r = compare(a, b, positions=[[10, 11, 12, 13], [7, 8, 9, 10, 11, 12]], token_ids=[[1, 2, 3, 4], list(range(6))])
    assert r.mismatch_count == 3 and r.tokens == 10
    assert r.worst["sample"] == 1 and r.worst["index"] == 4 and r.worst["position"] == 11 and r.worst["token_id"] == 4
    assert r.worst["rollout"] == float(a[1][4]) and r.worst["trainer"] == float(b[1][4])
    assert r.max_abs_diff == pytest.approx(0.25, abs=1e-6)
    total = sum(float((x.double() - y.double()).abs().sum()) for x, y in zip(a, b))
    assert r.mean_abs_diff == pytest.approx(total / 10)


def test_signed_zero_counts_by_bits():
    """0.0 and -0.0 are equal as numbers but are different fp32 bit patterns: counted, |diff| = 0."""
    r = compare([torch.tensor([0.0, -1.0])], [torch.tensor([-0.0, -1.0])])
    assert r.mismatch_count == 1 and r.max_abs_diff == 0.0 and r.worst["index"] == 0


def test_nan_is_the_worst_mismatch():
    r = compare([torch.tensor([-1.0, -2.0])], [torch.tensor([-1.5, float("nan")])])
    assert r.mismatch_count == 2 and r.worst["index"] == 1
    assert r.max_abs_diff == float("inf") and r.worst["abs_diff"] == float("inf")  # max(0.0, nan) is 0.0


def test_nan_before_a_finite_diff_is_still_inf():
    """The NaN sample first, then a finite one: the running max must not drop the NaN either way."""
    r = compare([torch.tensor([-1.0]), torch.tensor([-1.0])], [torch.tensor([float("nan")]), torch.tensor([-1.5])])
    assert r.mismatch_count == 2 and r.max_abs_diff == float("inf")


@pytest.mark.parametrize(
    "a, b, message",
    [
        ([torch.zeros(3)], [torch.zeros(4)], "3 rollout logprobs vs 4"),
        ([torch.zeros(3)], [torch.zeros(3, dtype=torch.float64)], "must be fp32"),
        ([torch.zeros(3)], [], "1 rollout samples vs 0"),
    ],
)
def test_incomparable_shapes_are_errors(a, b, message):
    with pytest.raises(ComparabilityError, match=message):
        compare(a, b)


def test_rollout_floats_must_be_exact_fp32():
    x = torch.randn(16)
    assert same_bits(rollout_tensor(x.tolist()), x)
    with pytest.raises(ComparabilityError, match="not fp32"):
        rollout_tensor([0.1])  # the Python float 0.1 is no fp32 value


def _pair(rollout: dict | None = None, trainer: dict | None = None) -> tuple[Sample, Scored]:
    s = Sample(
        group=0,
        prompt_ids=[5, 6, 7],
        response_ids=[8, 9],
        logprobs=[-1.0, -2.0],
        versions=[3, 3],
        engine=0,
        temperature=0.7,
        vocab_size=512,
    )
    t = Scored(
        token_ids=[8, 9],
        positions=[3, 4],
        logprobs=torch.tensor([-1.0, -2.0]),
        version=3,
        temperature=0.7,
        vocab_size=512,
    )
    return dataclasses.replace(s, **(rollout or {})), dataclasses.replace(t, **(trainer or {}))


def test_gate_passes_a_comparable_pair():
    s, t = _pair()
    check_comparable([s], [t], version=3)


@pytest.mark.parametrize(
    "rollout, trainer, message",
    [
        ({"versions": [3, 2]}, {}, "weight versions \\[2\\]"),
        ({}, {"version": 4}, "trainer scored with version 4"),
        ({}, {"token_ids": [8, 10]}, "other token ids"),
        ({}, {"positions": [2, 3]}, "positions"),
        ({}, {"temperature": 1.0}, "temperature"),
        ({}, {"vocab_size": 640}, "vocab range"),
        ({"top_k": 50}, {}, "top_k=50"),
        ({"logprobs": [-1.0]}, {}, "2 tokens but 1 logprobs"),
    ],
)
def test_gate_failures_are_errors_not_mismatches(rollout, trainer, message):
    s, t = _pair(rollout, trainer)
    with pytest.raises(ComparabilityError, match=message):
        check_comparable([s], [t], version=3)


def test_gate_passes_a_pair_drawn_and_scored_under_one_truncation():
    s, t = _pair({"top_k": 20, "top_p": 0.9}, {"top_k": 20, "top_p": 0.9})
    check_comparable([s], [t], version=3)
    s, t = _pair({"top_k": 0}, {"top_k": -1})  # both: off
    check_comparable([s], [t], version=3)
    s, t = _pair({"top_k": 20, "top_p": 0.9, "min_p": 0.05}, {"top_k": 20, "top_p": 0.9})
    with pytest.raises(ComparabilityError, match="min_p=0.05"):
        check_comparable([s], [t], version=3)


def test_a_token_outside_the_trainer_support_is_counted_and_refused():
    from vime.loop.consistency import refuse_outside_support

    rollout = [torch.tensor([-0.5, -1.0, -0.25])]
    trainer = [torch.tensor([-0.5, float("-inf"), -0.25])]
    result = compare(rollout, trainer)
    assert result.outside_support == 1 and result.mismatch_count == 1
    assert result.metrics()["outside_support"] == 1
    with pytest.raises(ComparabilityError, match="1 sampled token"):
        refuse_outside_support(result.outside_support, 0)
    refuse_outside_support(compare(rollout, rollout).outside_support, 0)


def _evidence(mode: str) -> list[dict]:
    """Real rl_kernel evidence of a small forward (linear, rms_norm, logprobs) in `mode`."""
    x, w, head = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((4, 64), (64, 64), (32, 64)))
    with rk.mode(mode), rk.evidence.recording() as ran:
        h = rk.rms_norm(rk.linear(x, w), torch.ones(64, dtype=torch.bfloat16), 1e-6)
        rk.logprobs(h, head, torch.tensor([1, 2, 3, 4]))
    return ran


STRICT = {b: "strict" for b in rk.BOUNDARIES}
NATIVE = {b: "native" for b in rk.BOUNDARIES}


def test_contract_gate_on_real_evidence():
    strict = _evidence("strict")
    assert {r["op"] for r in strict} == {"gemm", "rms_norm", "logprobs"}
    assert check_contracts(strict, strict, STRICT, STRICT) == {"gemm": "same", "logprobs": "same", "rms_norm": "same"}
    native = _evidence("native")
    assert set(check_contracts(native, native, NATIVE, NATIVE).values()) == {"native"}


def test_contract_gate_rejects_other_versions_devices_native_ops_and_missing_evidence():
    strict = _evidence("strict")
    other_version = [r | {"fingerprint": "0" * 16} if r["op"] == "gemm" else r for r in strict]
    with pytest.raises(ComparabilityError, match="trainer ran rl_kernel.gemm.torch.v1 \\[0{16}\\].*same rl_kernel"):
        check_contracts(strict, other_version, STRICT, STRICT)
    other_device = [r | {"device_type": "cuda"} if r["op"] == "gemm" else r for r in strict]
    with pytest.raises(ComparabilityError, match="op 'gemm': rollout ran contracts"):
        check_contracts(strict, other_device, STRICT, STRICT)
    with pytest.raises(ComparabilityError, match="ran op 'gemm' natively although boundary 'gemm' is strict"):
        check_contracts(strict, _evidence("native"), STRICT, STRICT)
    with pytest.raises(ComparabilityError, match="rollout reported no rl_kernel evidence"):
        check_contracts([], strict, STRICT, STRICT)
    # A boundary set native on purpose (operator ablation) is compared, but not contract-matched.
    ablated = STRICT | {"gemm": "native"}
    assert check_contracts(strict, strict, ablated, STRICT)["gemm"] == "native"


def test_sampling_log_softmax_pairs_with_the_trainers_logprobs():
    """A rollout that samples from full-vocab strict log-probs runs `log_softmax`, the trainer runs
    `logprobs`: declared equal entry by entry, so the gate pairs them (same backend and device)."""
    h, head = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    with rk.evidence.recording() as rollout:
        full = rk.log_softmax(rk.linear_fp32(h, head), 0.7)
    with rk.evidence.recording() as trainer:
        chosen = rk.logprobs(h, head, torch.tensor([1, 2, 3, 4]), 0.7)
    assert same_bits(full[torch.arange(4), torch.tensor([1, 2, 3, 4])], chosen)
    verdict = check_contracts(rollout, trainer, STRICT, STRICT)
    assert verdict["log_softmax"] == verdict["logprobs"] == "paired"
    with pytest.raises(ComparabilityError, match="'log_softmax' / 'logprobs'"):
        check_contracts(
            [r | {"device_type": "cuda"} if r["op"] == "log_softmax" else r for r in rollout], trainer, STRICT, STRICT
        )


def test_a_rollout_that_records_the_trainers_op_samples_with_its_partner_on_any_backend():
    """rl_kernel's GPU rollout engine samples from `log_softmax` (the torch backend's, on CUDA) and records
    `logprobs` (the Triton backend's, as the trainer): the recorded values are compared as 'same'; the
    sampler's op is reported, not paired. Without `logprobs` on the rollout side the pair is enforced."""
    h, head = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    with rk.evidence.recording() as sampler:
        rk.log_softmax(rk.linear_fp32(h, head), 0.7)
    with rk.evidence.recording() as trainer:
        rk.logprobs(h, head, torch.tensor([1, 2, 3, 4]), 0.7)
    other_backend = [r | {"backend": "other"} if r["op"] == "log_softmax" else r for r in sampler]
    verdict = check_contracts(other_backend + trainer, trainer, STRICT, STRICT)
    assert verdict["log_softmax"] == "sampling" and verdict["logprobs"] == "same"
    with pytest.raises(ComparabilityError, match="'log_softmax' / 'logprobs'"):
        check_contracts(other_backend, trainer, STRICT, STRICT)


def test_the_engines_sampler_is_a_rollout_only_sampling_op():
    """`gumbel_sample` (the strict engine's sampler) picks tokens and records no value: on the rollout side alone it
    is 'sampling'; any other op on one side only stays 'one-side'."""
    lp = rk.log_softmax(torch.randn(4, 32))
    with rk.evidence.recording() as sampler:
        rk.gumbel_sample_(lp, torch.arange(4))
    with rk.evidence.recording() as norm:
        rk.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-6)
    h, head = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    with rk.evidence.recording() as trainer:
        rk.logprobs(h, head, torch.tensor([1, 2, 3, 4]), 0.7)
    verdict = check_contracts(sampler + norm + trainer, trainer, STRICT, STRICT)
    assert verdict["gumbel_sample"] == "sampling" and verdict["rms_norm"] == "one-side"


GPU_GEMM_RECORD = """
import json, sys
import rl_kernel as rk
from vime.loop.consistency import check_contracts
from vime.errors import ComparabilityError
rk.set_canonical_tp(int(sys.argv[1]))  # the driver's C; it never runs the Triton GEMM itself
record = json.loads(sys.argv[2])
strict = {b: "strict" for b in rk.BOUNDARIES}
try:
    print(check_contracts([record], [record], strict, strict)["gemm"])
except ComparabilityError as e:
    print(f"rejected: {e}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("driver_tp, verdict", [(2, "same"), (1, "rejected: the rollout ran rl_kernel.gemm.triton.v2")])
def test_a_cpu_driver_checks_the_gpu_gemm_contract_of_its_deployment(driver_tp, verdict):
    """On the H200 the engines run the Triton GEMM contract, parametrised by the run's canonical TP; the
    driver (CPU, a fresh process that never ran it) must still know its fingerprint at the run's C, and
    reject another C. Regression: the driver said "[unknown]" and stopped every strict GPU run."""
    import json
    import subprocess
    import sys

    from rl_kernel.ops.gemm import triton_contract

    contract = triton_contract(2)
    record = {
        "op": "gemm",
        "contract_id": contract.id,
        "fingerprint": contract.fingerprint,
        "mode": "strict",
        "device_type": "cuda",
        "backend": "triton",
    }
    out = subprocess.run(
        [sys.executable, "-c", GPU_GEMM_RECORD, str(driver_tp), json.dumps(record)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith(verdict), out
