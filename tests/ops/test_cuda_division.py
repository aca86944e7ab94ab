"""The torch backend's CUDA bits, checked on CPU: CUDA torch divides a tensor by a host scalar as a product with
the scalar's reciprocal (rl_kernel.backends.torch.cuda_emulation), CPU torch divides. A strict kernel that divides
by a Python number therefore has CUDA bits its CPU run does not show (the H200's rms_norm at D = 1100). Each test
runs the torch backend as CUDA would (under CudaScalarDivision) and as CPU does, and asks for the same bits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_kernel as rk
from rl_kernel.backends.torch import norm as torch_norm
from rl_kernel.backends.torch import rope as torch_rope
from rl_kernel.backends.torch.cuda_emulation import CudaScalarDivision
from rl_kernel.backends.torch.numerics import blocked_sum, div_rn, sqrt32
from rl_kernel.bits import bit_mismatches, same_bits
from rl_kernel.selftest.accuracy import accuracy_cases

WIDTHS = [1, 63, 65, 128, 200, 1100, 1536, 2048, 4096, 5120]  # production: 128, 2048, 4096 (powers of two)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rms_norm_dividing_by_d(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch backend's rms_norm before the fix: `sum / D`, D a Python int (CUDA: sum * fl(1 / D))."""
    x32 = x.to(torch.float32)
    inv_rms = 1.0 / sqrt32(blocked_sum(x32 * x32) / x.shape[-1] + eps)
    return ((x32 * inv_rms.unsqueeze(-1)).to(x.dtype).to(torch.float32) * w.to(torch.float32)).to(x.dtype)


def test_cuda_scalar_division_changes_bits_unless_the_divisor_is_a_power_of_two():
    """The native twin: the CUDA rewrite moves last bits at D = 1100 (none at 4096), and div_rn is immune."""
    a = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e4
    with CudaScalarDivision() as mode:
        odd, pow2, rn = a / 1100, a / 4096, div_rn(a, 1100)
    assert bit_mismatches(odd, a / 1100) > 1000
    assert same_bits(pow2, a / 4096) and same_bits(rn, a / 1100)
    assert [d for _, _, d in mode.seen] == [1100.0, 4096.0]


def test_dividing_by_d_gave_rms_norm_other_bits_on_cuda():
    """The pre-fix formula, run as CUDA runs it, differs from its CPU bits at D = 1100 and 5120 (the H200 failure),
    not at 4096: what the tests below would catch."""
    gen = torch.Generator().manual_seed(0)
    for d, differs in ((1100, True), (5120, True), (4096, False)):
        x, w = (torch.randn(3000, d, generator=gen) * 3).half(), torch.randn(d, generator=gen).half()
        with CudaScalarDivision():
            on_cuda = _rms_norm_dividing_by_d(x, w, 1e-6)
        assert (bit_mismatches(on_cuda, _rms_norm_dividing_by_d(x, w, 1e-6)) > 0) == differs, d


@settings(max_examples=40, deadline=None, database=None)
@given(
    d=st.sampled_from(WIDTHS) | st.integers(1, 6000),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_has_its_cpu_bits_on_cuda(d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(200, d, generator=gen) * 3).to(dtype), torch.randn(200, d, generator=gen).to(dtype)
    w, w2 = torch.randn(d, generator=gen).to(dtype), torch.randn(d, generator=gen).to(dtype)
    heads = x[:192].view(24, 8, d)
    with CudaScalarDivision() as mode:
        cuda = torch_norm.rms_norm(x, w, 1e-6), *torch_norm.rms_norm_residual(x, res, w, 1e-6)
        cuda_heads = torch_norm.rms_norm_heads(heads, w, w2, 5, 1e-6)
    assert mode.seen == [], "a strict norm divides by a host scalar (CUDA: a product with its reciprocal)"
    assert same_bits(list(cuda), [torch_norm.rms_norm(x, w, 1e-6), *torch_norm.rms_norm_residual(x, res, w, 1e-6)])
    assert same_bits(cuda_heads, torch_norm.rms_norm_heads(heads, w, w2, 5, 1e-6))


@settings(max_examples=20, deadline=None, database=None)
@given(half=st.integers(1, 128), theta=st.sampled_from([1e4, 1e6, 1e6 / 3]), seed=st.integers(0, 2**16))
def test_rope_table_has_its_cpu_bits_on_cuda(half, theta, seed):
    """theta^(-2i / rotary_dim): at rotary_dim 96 or 80 the pre-fix `i / rotary_dim` moved bits on CUDA."""
    pos = torch.randint(0, 1 << 20, (64,), generator=torch.Generator().manual_seed(seed))
    with CudaScalarDivision() as mode:
        cuda = torch_rope.cos_sin(pos, 2 * half, theta)
    assert mode.seen == []
    assert same_bits(list(cuda), list(torch_rope.cos_sin(pos, 2 * half, theta)))


def test_no_strict_op_divides_by_a_host_scalar():
    """Every op of the selftest's accuracy table, strict on the torch backend, computes the same on CUDA."""
    rk.set_backend("torch")
    for op, (call, _) in accuracy_cases(torch.Generator().manual_seed(0)).items():
        with CudaScalarDivision() as mode:
            call()
        assert mode.seen == [], f"{op}: {mode.seen}"
