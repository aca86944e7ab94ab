"""Accuracy of the strict ops against fp64, next to native's; gradients of the differentiable ops
against fp64 autograd of plain reference implementations.

Forward (bf16 inputs, `rl_kernel.selftest.accuracy.measure_accuracy`, the numbers of docs/accuracy.md; ulp =
units in the last place of the output dtype, over outputs with |ref| >= max|ref| / 256):
- one-rounding ops (linear, silu_and_mul, rope, attention_varlen): <= 0.51 ulp - the single rounding to
  bf16 plus fp32 internal error below 0.01 ulp;
- rms_norm (with and without residual): <= 1.5 ulp - the contract rounds x * r to bf16 before the weight,
  as HF Qwen3 and vLLM do (0.5 ulp + up to 1 ulp carried through the weight);
- logprobs (fp32 out): <= 2e-6 absolute and <= 2 fp32 ulp (fp32 logits from the GEMM contract, LSE in fp64);
- strict is never worse than native by more than half an ulp (0.5 ulp, or 1e-6 absolute for logprobs).
Gradients (fp32 inputs): max |g - g_ref| <= 2e-6 * max |g_ref| per input (measured <= 4e-7).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import rl_kernel as rk
from rl_kernel.selftest.accuracy import measure_accuracy

ULP_BOUND = {
    "linear (+bias)": 0.51,
    "silu_and_mul": 0.51,
    "rope": 0.51,
    "attention_varlen": 0.51,
    "rms_norm": 1.5,
    "rms_norm+residual": 1.5,
    "logprobs (fp32 out)": 2.0,
}


@pytest.fixture(scope="module")
def accuracy() -> dict[str, dict]:
    return {row["op"]: row for row in measure_accuracy()}


@pytest.mark.parametrize("op", sorted(ULP_BOUND))
def test_strict_error_bound(accuracy, op):
    strict = accuracy[op]["strict"]
    assert strict["max_ulp"] <= ULP_BOUND[op], strict
    if op.startswith("logprobs"):
        assert strict["max_abs"] <= 2e-6, strict


@pytest.mark.parametrize("op", sorted(ULP_BOUND))
def test_strict_not_worse_than_native(accuracy, op):
    strict, native = accuracy[op]["strict"], accuracy[op]["native"]
    assert strict["max_ulp"] <= native["max_ulp"] + 0.5, (strict, native)
    if op.startswith("logprobs"):
        assert strict["max_abs"] <= native["max_abs"] + 1e-6


# --- gradients ----------------------------------------------------------------------------------------------------


def _grads(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor | list[torch.Tensor]):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs, gos = (out, grad_out) if isinstance(out, tuple) else ((out,), [grad_out])
    return torch.autograd.grad(outs, leaves, [g.to(o.dtype) for o, g in zip(outs, gos)])


def _check(strict_fn, ref_fn, inputs: list[torch.Tensor], grad_out, rtol: float = 2e-6) -> None:
    got = _grads(strict_fn, inputs, grad_out)
    want = _grads(
        ref_fn,
        [t.double() for t in inputs],
        [g.double() for g in grad_out] if isinstance(grad_out, list) else grad_out.double(),
    )
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == inputs[i].dtype
        err, scale = float((a.double() - b).abs().max()), float(b.abs().max())
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
        print(f"{test} input {i}: max |g - g_ref| / max |g_ref| = {err / scale:.2e}")  # for docs/accuracy.md
        assert err <= rtol * scale, f"input {i}: max |g - g_ref| {err:.3g} vs max |g_ref| {scale:.3g}"


def _r(gen, *shape, scale=1.0):
    return torch.randn(shape, generator=gen) * scale


def test_linear_grad(gen):
    x, w, b = _r(gen, 9, 96), _r(gen, 40, 96), _r(gen, 40)
    _check(rk.linear, lambda x, w, b: x @ w.T + b, [x, w, b], _r(gen, 9, 40))


def _rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_grad(gen):
    x, w = _r(gen, 6, 200, scale=2.0), _r(gen, 200)
    _check(lambda x, w: rk.rms_norm(x, w, 1e-6), _rms_ref, [x, w], _r(gen, 6, 200))


def test_rms_norm_residual_grad(gen):
    """Both outputs (y and the sum s = x + residual) carry gradient to x and residual."""
    x, w, res = _r(gen, 6, 200), _r(gen, 200), _r(gen, 6, 200)
    _check(
        lambda x, w, r: rk.rms_norm(x, w, 1e-6, r),
        lambda x, w, r: (_rms_ref(x + r, w), x + r),
        [x, w, res],
        [_r(gen, 6, 200), _r(gen, 6, 200)],
    )


def test_silu_and_mul_grad(gen):
    x = _r(gen, 7, 128, scale=3.0)
    _check(rk.silu_and_mul, lambda x: torch.nn.functional.silu(x[:, :64]) * x[:, 64:], [x], _r(gen, 7, 64))


@pytest.mark.parametrize("rotary_dim", [None, 16])
def test_rope_grad(gen, rotary_dim):
    x, pos = _r(gen, 10, 3, 32), torch.randint(0, 5000, (10,), generator=gen)
    rd = rotary_dim or 32

    def ref(x):
        inv = 1e4 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        ang = pos.double().unsqueeze(-1) * inv
        c, s = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rd:]], -1)

    _check(lambda x: rk.rope(x, pos, 1e4, rotary_dim), ref, [x], _r(gen, 10, 3, 32))


def test_attention_varlen_grad(gen):
    lens, scale = [30, 70], 0.25
    q, k, v = _r(gen, 100, 4, 16), _r(gen, 100, 2, 16), _r(gen, 100, 2, 16)
    cu = torch.tensor([0, 30, 100], dtype=torch.int32)

    def ref(q, k, v):
        outs = []
        for a, n in zip((0, 30), lens):
            qs, ks, vs = q[a : a + n], k[a : a + n].repeat_interleave(2, 1), v[a : a + n].repeat_interleave(2, 1)
            s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        return torch.cat(outs)

    _check(lambda q, k, v: rk.attention_varlen(q, k, v, cu, scale), ref, [q, k, v], _r(gen, 100, 4, 16))


def test_logprobs_grad_with_padded_vocab(gen):
    """vocab_size < LM-head rows: padded rows get exactly zero gradient; per-row temperatures."""
    h, w = _r(gen, 8, 32), _r(gen, 50, 32, scale=0.3)
    targets, temps, vocab = torch.randint(0, 45, (8,), generator=gen), torch.rand(8, generator=gen) + 0.5, 45

    def ref(h, w):
        logits = (h @ w[:vocab].T) / temps.double().unsqueeze(-1)
        return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def strict(h, w):
        return rk.logprobs(h, w, targets, temps, vocab_size=vocab)

    _check(strict, ref, [h, w], _r(gen, 8))
    _, grad_w = _grads(strict, [h, w], _r(gen, 8))
    assert torch.equal(grad_w[vocab:], torch.zeros_like(grad_w[vocab:]))
