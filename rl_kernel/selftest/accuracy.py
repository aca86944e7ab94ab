"""Accuracy against fp64: each op's error, strict and native, from bf16 inputs (the table in docs/accuracy.md)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

import rl_kernel as rk
from rl_kernel.selftest.matrix import cu_seqlens, randn


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (x in fp64); the smallest normal spacing at 0 and below."""
    info = torch.finfo(dtype)
    _, e = torch.frexp(x.abs().clamp_min(info.tiny))  # |x| = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.full_like(x, info.eps), e - 1)


def error_stats(y: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Errors of y against the fp64 `ref`: max |y - ref|; that over max |ref|; and the max error in units
    of the last place of y's dtype, over the elements with |ref| >= max |ref| / 256 (below that, an
    output is the result of cancellation and its ulp says nothing of the op; its error is in max_abs)."""
    err = (y.double() - ref).abs()
    scale = ref.abs().max()
    big = ref.abs() >= scale / 256
    return {
        "max_abs": float(err.max()),
        "max_rel": float(err.max() / scale),
        "max_ulp": float((err / ulp(ref, y.dtype))[big].max()),
    }


def _ref_attention(q, k, v, lens, scale):
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start : start + n].double() for t in (q, k, v))
        rep = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        start += n
    return torch.cat(outs)


def _ref_rope(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = pos.double().unsqueeze(-1) * inv
    c, s = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def accuracy_cases(gen: torch.Generator, device: str = "cpu") -> dict[str, tuple[Callable, torch.Tensor]]:
    """op -> (call of the op, its fp64 reference from the same bf16 inputs)."""
    bf16 = torch.bfloat16

    def r(*shape, scale=1.0):
        return randn(gen, shape, bf16, device, scale)

    x, w, b = r(64, 1024), r(256, 1024, scale=0.05), r(256)
    xn, wn, res = r(64, 1024, scale=2.0), r(1024), r(64, 1024)
    xs = r(64, 512, scale=3.0)
    xr, pos = r(64, 8, 128), torch.randint(0, 32768, (64,), generator=gen).to(device)
    lens = [100, 37, 64]
    q, k, v = r(sum(lens), 8, 64), r(sum(lens), 2, 64), r(sum(lens), 2, 64)
    h, wl = r(64, 256), r(2048, 256, scale=0.2)
    tg = torch.randint(0, 2000, (64,), generator=gen).to(device)
    s64 = (xn.double() + res.double()).to(bf16)  # the residual sum is rounded once, then normalised

    def rms_ref(t):
        t = t.double()
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * wn.double()

    g, u = xs.double()[:, :256], xs.double()[:, 256:]
    logits = (h.double() @ wl.double()[:2000].T) / 0.8
    return {
        "linear (+bias)": (lambda: rk.linear(x, w, b), x.double() @ w.double().T + b.double()),
        "rms_norm": (lambda: rk.rms_norm(xn, wn, 1e-6), rms_ref(xn)),
        "rms_norm+residual": (lambda: rk.rms_norm(xn, wn, 1e-6, res)[0], rms_ref(s64)),
        "silu_and_mul": (lambda: rk.silu_and_mul(xs), g / (1 + torch.exp(-g)) * u),
        "rope": (lambda: rk.rope(xr, pos, 1e6), _ref_rope(xr, pos, 1e6)),
        "attention_varlen": (
            lambda: rk.attention_varlen(q, k, v, cu_seqlens(lens, device), 0.125),
            _ref_attention(q, k, v, lens, 0.125),
        ),
        "logprobs (fp32 out)": (
            lambda: rk.logprobs(h, wl, tg, 0.8, vocab_size=2000),
            logits.log_softmax(-1).gather(-1, tg.unsqueeze(-1)).squeeze(-1),
        ),
    }


def measure_accuracy(device: str = "cpu", seed: int = 0) -> list[dict]:
    """Per op, error statistics of strict and native against fp64 (bf16 inputs, bf16 outputs except logprobs)."""
    rows = []
    for op, (call, ref) in accuracy_cases(torch.Generator().manual_seed(seed), device).items():
        row = {"op": op}
        for name in ("strict", "native"):
            with rk.mode(name):
                row[name] = error_stats(call().cpu(), ref.cpu())
        rows.append(row)
    return rows


def format_accuracy(rows: list[dict]) -> str:
    lines = ["| op | strict max abs | strict max ulp | native max abs | native max ulp |", "|---|---|---|---|---|"]
    for r in rows:
        s, n = r["strict"], r["native"]
        lines.append(
            f"| {r['op']} | {s['max_abs']:.3g} | {s['max_ulp']:.3g} | {n['max_abs']:.3g} | {n['max_ulp']:.3g} |"
        )
    return "\n".join(lines)
