"""Exact top-k / top-p / min-p (`rl_kernel.ops.truncation`) and the entropy of the LM-head pass.

The support rule against an independent Python reference (hypothesis rows, ties), the renormalised
log-probability's bits (the trainer's `rk.logprobs(truncation=...)` equals the engine's
`truncate_log_softmax` entry on every token; row subsets and tiles change no bit), the native twin (the
full softmax a trainer would otherwise score differs on every token), gradients and entropy against fp64
references, and bad values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_kernel as rk
from rl_kernel.backends.torch import truncation as kernels
from rl_kernel.bits import bits
from rl_kernel.ops.truncation import Truncation, truncate_log_softmax

SCALE = float(1 << kernels.FIXED_POINT_BITS)


def reference_support(row: list[float], t: Truncation) -> list[int]:
    """The contract's rule written out in Python on one fp32 row (math.exp; ints for the fixed point)."""
    real = [v for v in range(len(row)) if row[v] != -math.inf]
    order = sorted(real, key=lambda v: (-row[v], v))
    top = row[order[0]]
    e = [math.exp(row[v] - top) for v in order]
    cum, c = [], 0
    for x in e:
        c += round(x * SCALE)
        cum.append(c)
    n = len(order)
    n_k = t.top_k if 0 < t.top_k < n else n
    n_p = n_k
    if t.top_p < 1.0:
        n_p = sum(1 for i in range(n_k) if (cum[i - 1] if i else 0) < t.top_p * cum[n_k - 1])
    n_m = sum(1 for x in e if x >= t.min_p) if t.min_p > 0 else n
    return sorted(order[: max(1, min(n_k, n_p, n_m))])


def _rows(gen: torch.Generator, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    return rk.log_softmax(torch.randn(rows, vocab, generator=gen) * scale)


truncations = st.builds(
    Truncation,
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 17, 64, 1000]),
    top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1, 1e-6]),
    min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.99]),
)


@settings(max_examples=150, deadline=None)
@given(t=truncations, seed=st.integers(0, 2**31 - 1), vocab=st.integers(1, 200), scale=st.sampled_from([0.1, 3.0]))
def test_support_matches_the_rule_written_out(t, seed, vocab, scale):
    lp = _rows(torch.Generator().manual_seed(seed), 3, vocab, scale)
    out = truncate_log_softmax(lp, t)
    for r in range(lp.shape[0]):
        kept = torch.isfinite(out[r]).nonzero().squeeze(-1).tolist()
        want = reference_support(lp[r].tolist(), t) if t.active else list(range(vocab))
        assert kept == want, (r, t)


def test_ties_are_broken_by_token_id():
    lp = rk.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0]]))
    assert torch.isfinite(truncate_log_softmax(lp, Truncation(top_k=2))).nonzero()[:, 1].tolist() == [1, 3]
    assert torch.isfinite(truncate_log_softmax(lp, Truncation(top_k=4))).nonzero()[:, 1].tolist() == [1, 2, 3, 4]
    # min-p keeps a tie whole (p >= min_p * p_max is the same test for equal p)
    assert torch.isfinite(truncate_log_softmax(lp, Truncation(min_p=0.5))).nonzero()[:, 1].tolist() == [1, 3, 4]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    lp = rk.log_softmax(p.log().to(torch.float32))
    keep = lambda top_p: torch.isfinite(truncate_log_softmax(lp, Truncation(top_p=top_p))).sum().item()  # noqa: E731
    assert [keep(x) for x in (0.4, 0.6, 0.79, 0.81, 0.96)] == [1, 2, 2, 3, 4]


def test_renormalised_values_against_fp64():
    gen = torch.Generator().manual_seed(1)
    lp = _rows(gen, 16, 300)
    for t in (Truncation(top_k=20, top_p=0.9), Truncation(min_p=0.05), Truncation(top_p=0.5)):
        out = truncate_log_softmax(lp, t)
        kept = torch.isfinite(out)
        lp64 = torch.where(kept, lp.to(torch.float64), -math.inf)
        ref = lp64 - torch.logsumexp(lp64, -1, keepdim=True)
        assert torch.allclose(out[kept].to(torch.float64), ref[kept], rtol=0, atol=2e-6)
        mass = torch.where(kept, out.to(torch.float64).exp(), 0.0).sum(-1)
        assert torch.allclose(mass, torch.ones_like(mass), atol=1e-5)


def test_rows_are_independent_of_the_batch():
    gen = torch.Generator().manual_seed(2)
    lp = _rows(gen, 9, 257)
    t = Truncation(top_k=30, top_p=0.8, min_p=0.01)
    whole = truncate_log_softmax(lp, t)
    for a, b in ((0, 1), (3, 7), (8, 9)):
        assert torch.equal(bits(truncate_log_softmax(lp[a:b], t)), bits(whole[a:b]))
    mixed = [t if i % 2 else Truncation() for i in range(9)]
    per_row = truncate_log_softmax(lp, mixed)
    assert torch.equal(bits(per_row[1::2]), bits(whole[1::2])) and torch.equal(bits(per_row[::2]), bits(lp[::2]))


def _lm_head(gen, rows=40, d=32, vocab=300, dtype=torch.bfloat16):
    h = torch.randn(rows, d, generator=gen).to(dtype)
    w = (torch.randn(vocab, d, generator=gen) * 0.5).to(dtype)
    temps = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    return h, w, temps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trainer_equals_engine_on_every_token(gen, dtype):
    h, w, temps = _lm_head(gen, dtype=dtype)
    vocab = 290  # 10 padded LM-head rows
    t = Truncation(top_k=20, top_p=0.9)
    engine = truncate_log_softmax(rk.log_softmax(rk.linear_fp32(h, w), temps, vocab_size=vocab), t)
    sampled = torch.multinomial(engine.exp(), 1, generator=gen).squeeze(-1)
    trainer = rk.logprobs(h, w, sampled, temps, vocab_size=vocab, truncation=t)
    assert torch.isfinite(trainer).all()
    assert torch.equal(bits(trainer), bits(engine.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)))
    # row subsets (other micro-batches / tiles) give the same bits
    assert torch.equal(bits(rk.logprobs(h[5:9], w, sampled[5:9], temps[5:9], vocab, truncation=t)), bits(trainer[5:9]))
    # native twin: the trainer's full softmax differs from the truncated logprob on every token
    full = rk.logprobs(h, w, sampled, temps, vocab_size=vocab)
    assert bool((bits(full) != bits(trainer)).all())


def test_native_truncation_differs_from_the_contract(gen):
    h, w, temps = _lm_head(gen, rows=64, vocab=2048)
    t = Truncation(top_k=200, top_p=0.9)
    strict = truncate_log_softmax(rk.log_softmax(rk.linear_fp32(h, w), temps), t)
    with rk.mode("native", "logprob"):
        native = truncate_log_softmax(rk.log_softmax(rk.linear_fp32(h, w), temps), t)
    kept = torch.isfinite(strict) & torch.isfinite(native)
    assert bool((bits(strict[kept]) != bits(native[kept])).any())


def test_a_target_outside_the_support_gets_minus_inf(gen):
    h, w, temps = _lm_head(gen)
    t = Truncation(top_k=3)
    engine = truncate_log_softmax(rk.log_softmax(rk.linear_fp32(h, w), temps), t)
    outside = torch.isneginf(engine).to(torch.float64).multinomial(1, generator=gen).squeeze(-1)
    assert torch.isneginf(rk.logprobs(h, w, outside, temps, truncation=t)).all()


def _fp64_reference(h, w, targets, temps, vocab, support=None):
    """(logprob, entropy) in fp64 autograd: full softmax entropy; logprob over `support` (bool [T, V])."""
    z = (h @ w.T)[:, :vocab] / temps.unsqueeze(-1)
    lp = z.log_softmax(-1)
    ent = -(lp.exp() * lp).sum(-1)
    if support is not None:
        z = z.masked_fill(~support[:, :vocab], -math.inf)
    return z.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), ent


@pytest.mark.parametrize("truncated", [False, True])
def test_entropy_and_gradients_against_fp64(gen, truncated):
    h, w, temps = _lm_head(gen, dtype=torch.float32, vocab=300)
    vocab = 290
    t = Truncation(top_k=25, top_p=0.95) if truncated else None
    engine = rk.log_softmax(rk.linear_fp32(h, w), temps, vocab_size=vocab)
    if t is not None:
        engine = truncate_log_softmax(engine, t)
    targets = torch.multinomial(engine.exp(), 1, generator=gen).squeeze(-1)
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = rk.logprobs(hs, ws, targets, temps, vocab_size=vocab, truncation=t, with_entropy=True)
    g_lp, g_ent = torch.randn(lp.shape, generator=gen), torch.randn(lp.shape, generator=gen)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    support = torch.isfinite(engine) if t is not None else None
    ref_lp, ref_ent = _fp64_reference(h64, w64, targets, temps, vocab, support)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    assert torch.allclose(lp.double(), ref_lp.detach(), atol=2e-5)
    assert torch.allclose(ent.double(), ref_ent.detach(), atol=2e-5)
    assert torch.allclose(hs.grad.double(), h64.grad, atol=1e-4, rtol=1e-4)
    assert torch.allclose(ws.grad.double(), w64.grad, atol=1e-4, rtol=1e-4)


def test_entropy_changes_no_logprob_bit_and_is_row_invariant(gen):
    h, w, temps = _lm_head(gen)
    plain = rk.logprobs(h, w, torch.zeros(40, dtype=torch.int64), temps)
    lp, ent = rk.logprobs(h, w, torch.zeros(40, dtype=torch.int64), temps, with_entropy=True)
    assert torch.equal(bits(lp), bits(plain))
    _, part = rk.logprobs(h[3:11], w, torch.zeros(8, dtype=torch.int64), temps[3:11], with_entropy=True)
    assert torch.equal(bits(part), bits(ent[3:11]))


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 1.0}, "min_p")],
)
def test_bad_values_are_refused(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Truncation(**kwargs)


def test_truncation_is_recorded_as_its_own_contract(gen):
    h, w, temps = _lm_head(gen)
    with rk.evidence.recording() as ran:
        rk.logprobs(h, w, torch.zeros(40, dtype=torch.int64), temps, truncation=Truncation(top_p=0.9))
    ops = {r["op"]: r["mode"] for r in ran}
    assert ops["truncation"] == "strict" and ops["log_softmax"] == "strict"


@settings(max_examples=60, deadline=None)
@given(t=truncations, seed=st.integers(0, 2**31 - 1))
def test_working_on_the_top_k_prefix_changes_no_bit(t, seed):
    """With a top-k on every row, only the first k sorted positions are worked on: the same bits as all V."""
    lp = _rows(torch.Generator().manual_seed(seed), 4, 300)
    k = max(t.top_k, 1)
    params = (torch.full((4,), k), torch.full((4,), float(t.top_p), dtype=torch.float64))
    params += (torch.full((4,), float(t.min_p), dtype=torch.float64),)
    whole, narrow = kernels.truncate(lp, *params), kernels.truncate(lp, *params, width=k)
    assert all(
        torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b)
        for a, b in zip(whole, narrow)
    )
