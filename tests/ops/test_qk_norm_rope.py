"""rk.qk_norm_rope on CPU (the torch backend: the two ops composed) keeps the bits of rk.qk_norm then rk.rope in
strict mode, a token's bits whatever batch it is in, and records both contracts; native mode runs both native forms
(the twin: other bits). The one-launch Triton kernel's equality is checked under Triton's interpreter
(tests/gpu/interpreter_checks.py, part qk_norm_rope) and on CUDA (tests/gpu/test_triton_kernels.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_kernel as rk
from rl_kernel.bits import same_bits


def _inputs(t: int, q_heads: int, k_heads: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (q_heads + 2 * k_heads) * d, generator=g) * 3).to(torch.bfloat16)
    qk = qkv[:, : (q_heads + k_heads) * d].view(t, q_heads + k_heads, d)  # strided, as the model's view
    wq, wk = torch.randn(d, generator=g).to(torch.bfloat16), torch.randn(d, generator=g).to(torch.bfloat16)
    return qk, wq, wk, torch.randint(0, 1 << 16, (t,), generator=g)


@settings(max_examples=8, deadline=None, database=None)
@given(
    t=st.integers(1, 9),
    heads=st.sampled_from([(4, 2), (3, 1), (8, 8)]),
    d=st.sampled_from([64, 128, 200]),
    seed=st.integers(0, 1000),
)
def test_strict_is_the_two_ops_and_rowwise(t, heads, d, seed):
    qk, wq, wk, pos = _inputs(t, *heads, d, seed)
    rotary = 128 if d == 200 else d
    with rk.mode("strict"), rk.evidence.recording() as ran:
        fused = rk.qk_norm_rope(qk, wq, wk, heads[0], 1e-6, pos, 1e6, rotary)
        two = rk.rope(rk.qk_norm(qk, wq, wk, heads[0], 1e-6), pos, 1e6, rotary)
        alone = rk.qk_norm_rope(qk[-1:], wq, wk, heads[0], 1e-6, pos[-1:], 1e6, rotary)
    assert {r["op"] for r in ran} == {"rms_norm", "rope"} and {r["mode"] for r in ran} == {"strict"}
    assert fused.shape == qk.shape and same_bits(fused, two) and same_bits(alone, fused[-1:])


def test_native_mode_runs_the_native_forms_and_differs():
    qk, wq, wk, pos = _inputs(64, 4, 2, 128, 0)
    with rk.mode("strict"):
        strict = rk.qk_norm_rope(qk, wq, wk, 4, 1e-6, pos, 1e6)
    with rk.mode("native"), rk.evidence.recording() as ran:
        native = rk.qk_norm_rope(qk, wq, wk, 4, 1e-6, pos, 1e6)
    assert {r["mode"] for r in ran} == {"native"}
    assert not same_bits(native, strict)
