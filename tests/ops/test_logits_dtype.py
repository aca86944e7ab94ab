"""The deployment's logit dtype (`rl_kernel.set_logits_dtype`): under bfloat16 the logprob contracts round the
GEMM contract's fp32 logits once to bf16, as a native bf16 F.linear returns them. What must hold: the trainer's
`logprobs` and the engine's `log_softmax` still agree bit for bit, the values are those of the rounded logits,
the setting is in the fingerprints (two engines with different settings cannot pass as one), and it changes the
bits (twin)."""

from __future__ import annotations

import pytest
import torch

import rl_kernel as rk
from rl_kernel.ops.logprob import LOG_SOFTMAX, LOGPROBS


@pytest.fixture
def logits_dtype():
    """Sets the process's logit dtype for a test and restores it after."""
    saved = rk.logits_dtype()
    yield rk.set_logits_dtype
    rk.set_logits_dtype(saved)


def _case(gen, t=23, d=64, v=300, real=290):
    h = torch.randn(t, d, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=gen) * 0.3).to(torch.bfloat16)
    targets = torch.randint(0, real, (t,), generator=gen)
    temps = torch.rand(t, generator=gen, dtype=torch.float64) + 0.5
    return h, w, targets, temps, real


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_logprobs_equal_the_engines_log_softmax_entries(gen, logits_dtype, name):
    logits_dtype(name)
    h, w, targets, temps, real = _case(gen)
    scored = rk.logprobs(h, w, targets, temps, vocab_size=real)
    sampled = rk.log_softmax(rk.linear_fp32(h, w), temps, vocab_size=real)
    assert torch.equal(scored.view(torch.int32), sampled.gather(1, targets[:, None]).squeeze(1).view(torch.int32))


def test_bf16_logits_are_the_rounded_chain_and_differ_from_fp32(gen, logits_dtype):
    h, w, targets, temps, real = _case(gen)
    logits_dtype("float32")
    fp32 = rk.logprobs(h, w, targets, temps, vocab_size=real)
    logits_dtype("bfloat16")
    bf16 = rk.logprobs(h, w, targets, temps, vocab_size=real)
    rounded = rk.linear_fp32(h, w).to(torch.bfloat16)[:, :real].double() / temps[:, None]
    ref = torch.log_softmax(rounded, -1).gather(1, targets[:, None]).squeeze(1)
    assert float((bf16.double() - ref).abs().max()) < 1e-6
    assert int((fp32.view(torch.int32) != bf16.view(torch.int32)).sum()) > 0  # twin: the setting moves bits


def test_the_logit_dtype_is_in_the_fingerprints(logits_dtype):
    seen = {}
    for name in ("float32", "bfloat16"):
        logits_dtype(name)
        for spec in (LOGPROBS, LOG_SOFTMAX):
            contract = spec.in_force()["torch"]
            assert dict(contract.params)["logits_dtype"] == name
            seen[(spec.op, name)] = contract.fingerprint
    assert seen[("logprobs", "float32")] != seen[("logprobs", "bfloat16")]
    assert seen[("log_softmax", "float32")] != seen[("log_softmax", "bfloat16")]


def test_an_unknown_logit_dtype_is_refused(logits_dtype):
    with pytest.raises(ValueError, match="logits dtype must be one of"):
        logits_dtype("float16")
