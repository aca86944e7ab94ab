"""Row-wise strict ops give a row the same bits whatever batch, position, padding or thread count it
is computed with: linear (with and without bias), rms_norm (with and without residual), silu_and_mul,
rope (full and partial rotary) and logprobs (per-row temperature, vocab_size < LM-head rows).

Every output element is compared by its raw bits. The native twins run where torch breaks the property
on every CPU, whatever its instruction set (`NOT_FREE`): a reduction torch splits over threads only when
there are fewer output rows than threads. Whether torch's other kernels keep a row's bits (GEMM,
log_softmax) depends on the CPU's code paths, and the elementwise ops keep them by construction: no
input makes native differ there on every CPU, so those cases have no twin.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_kernel as rk
from rl_kernel.bits import max_abs_diff, same_bits

SETTINGS = settings(max_examples=6, deadline=None, database=None)
WIDE = 1 << 17  # a row this wide is one reduction that native torch splits across threads
RowFn = Callable[[torch.Tensor], torch.Tensor]


def _make_cases() -> dict[str, tuple[RowFn, int]]:
    """name -> (fn(row index tensor of any shape) -> outputs [*index.shape, ...], number of rows)."""
    g = torch.Generator().manual_seed(1)
    bf16, f32 = torch.bfloat16, torch.float32

    def r(*shape, dtype=bf16, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    cases: dict[str, tuple[RowFn, int]] = {}
    for dtype, tag in ((bf16, "bf16"), (f32, "fp32")):
        x, w, b = r(24, 256, dtype=dtype), r(80, 256, dtype=dtype), r(80, dtype=dtype)
        cases[f"linear_{tag}"] = (lambda i, x=x, w=w: rk.linear(x[i], w), 24)
        cases[f"linear_bias_{tag}"] = (lambda i, x=x, w=w, b=b: rk.linear(x[i], w, b), 24)
        h, wl = r(24, 64, dtype=dtype), r(512, 64, dtype=dtype)
        t, temps = torch.randint(0, 490, (24,), generator=g), torch.rand(24, generator=g) + 0.5
        cases[f"logprobs_{tag}"] = (
            lambda i, h=h, wl=wl, t=t, temps=temps: rk.logprobs(
                h[i.reshape(-1)], wl, t[i.reshape(-1)], temps[i.reshape(-1)], vocab_size=490
            ).reshape(i.shape),
            24,
        )
    xn, wn, res = r(24, 1024, scale=2.0), r(1024), r(24, 1024)
    cases["rms_norm_bf16"] = (lambda i: rk.rms_norm(xn[i], wn, 1e-6), 24)
    cases["rms_norm_residual_bf16"] = (lambda i: torch.stack(rk.rms_norm(xn[i], wn, 1e-6, res[i]), -2), 24)
    xw, ww = r(32, WIDE, dtype=f32), r(WIDE, dtype=f32)
    cases["rms_norm_wide_fp32"] = (lambda i: rk.rms_norm(xw[i], ww, 1e-6), 32)
    xs = r(24, 512, scale=3.0)
    cases["silu_and_mul_bf16"] = (lambda i: rk.silu_and_mul(xs[i]), 24)
    xr, pos = r(24, 4, 64), torch.randint(0, 40000, (24,), generator=g)
    cases["rope_bf16"] = (lambda i: rk.rope(xr[i.reshape(-1)], pos[i.reshape(-1)], 1e6).reshape(*i.shape, 4, 64), 24)
    cases["rope_partial_bf16"] = (
        lambda i: rk.rope(xr[i.reshape(-1)], pos[i.reshape(-1)], 1e4, rotary_dim=32).reshape(*i.shape, 4, 64),
        24,
    )
    return cases


CASES = _make_cases()

# Cases whose native form is not invariant because of how torch computes it, whatever the instruction
# set: torch splits one reduction over threads only when there are fewer output rows than threads, so a
# wide row alone is summed in per-thread parts (with 2 threads), the same row among others in one pass.
NOT_FREE = {
    "batch": ["rms_norm_wide_fp32"],
    "padding": ["rms_norm_wide_fp32"],
    "threads": ["rms_norm_wide_fp32"],
}


# --- batch size and row position ------------------------------------------------------------------------


def _in_batch(fn: RowFn, row: int, rows: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows.clone()
    rows[pos] = row
    return fn(torch.tensor([row]))[0], fn(rows)[pos]


@pytest.mark.parametrize("name", sorted(CASES))
@SETTINGS
@given(data=st.data())
def test_batch_and_position_strict(name, data):
    fn, n = CASES[name]
    row = data.draw(st.integers(0, n - 1), label="row")
    size = data.draw(st.integers(1, min(2 * n, 20)), label="batch size")
    rows = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), min_size=size, max_size=size), label="others"))
    pos = data.draw(st.integers(0, size - 1), label="position")
    alone, batched = _in_batch(fn, row, rows, pos)
    assert same_bits(alone, batched), f"{name}: row {row} alone vs at {pos} of {size}: {max_abs_diff(alone, batched)}"


def _rows_alone_vs_together(fn: RowFn, n: int) -> int:
    """How many of the n rows get other bits computed alone than computed all together, 2 threads (the
    caller restores the thread count). For NOT_FREE cases alone means split over the threads; every
    row is tried, as a given row keeps its bits by chance (about 1 row in 5 differs on the CPUs seen)."""
    torch.set_num_threads(2)
    together = fn(torch.arange(n))
    return sum(not same_bits(fn(torch.tensor([i]))[0], together[i]) for i in range(n))


@pytest.mark.parametrize("name", NOT_FREE["batch"])
def test_batch_and_position_native(name):
    """Native twin: a wide fp32 RMSNorm row is batch-dependent on every CPU (asserted over all rows, each
    alone vs all together)."""
    fn, n = CASES[name]
    with rk.mode("native"):
        split = _rows_alone_vs_together(fn, n)
    assert split > 0, f"native {name}: every wide row alone (split over threads) kept its bits in the batch"


# --- padding and packing ----------------------------------------------------------------------------------


def _padded_vs_packed(fn: RowFn, n: int, lens: list[int], width: int, fill: torch.Tensor):
    padded = fill.view(len(lens), width) % n
    packed = torch.cat([padded[b, :k] for b, k in enumerate(lens)])
    out = fn(padded)
    return fn(packed), torch.cat([out[b, :k] for b, k in enumerate(lens)])


@pytest.mark.parametrize("name", sorted(CASES))
@SETTINGS
@given(data=st.data())
def test_padding_and_packing_strict(name, data):
    """Rows packed back to back vs the same rows right-padded into [B, L] (padding slots hold other rows)."""
    fn, n = CASES[name]
    lens = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4), label="lengths")
    width = max(lens) + data.draw(st.integers(0, 3), label="extra padding")
    fill = torch.tensor(
        data.draw(st.lists(st.integers(0, 10**6), min_size=len(lens) * width, max_size=len(lens) * width), label="rows")
    )
    packed, unpadded = _padded_vs_packed(fn, n, lens, width, fill)
    assert same_bits(packed, unpadded), f"{name} lens {lens} width {width}: {max_abs_diff(packed, unpadded)}"


@pytest.mark.parametrize("name", NOT_FREE["padding"])
def test_padding_and_packing_native(name):
    """Native twin: a lone packed wide row is split over the threads, the same row in a padded batch is not
    (asserted over all rows)."""
    fn, n = CASES[name]
    with rk.mode("native"):
        split = _rows_alone_vs_together(fn, n)
    assert split > 0, f"native {name}: every wide row packed alone (split over threads) kept its bits padded"


# --- thread count -------------------------------------------------------------------------------------------


def _one_and_two_threads(fn: RowFn, n: int, alone: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole batch and the first `alone` rows alone, with 1 thread and with 2 (restored by the
    conftest fixture)."""

    def run():
        return [fn(torch.arange(n))] + [fn(torch.tensor([i])) for i in range(alone)]

    torch.set_num_threads(1)
    one = run()
    torch.set_num_threads(2)
    return list(zip(one, run()))


@pytest.mark.parametrize("name", sorted(CASES))
def test_threads_strict(name):
    fn, n = CASES[name]
    for a, b in _one_and_two_threads(fn, n, alone=min(n, 8)):
        assert same_bits(a, b), f"{name}: 1 vs 2 threads differ by {max_abs_diff(a, b)}"


@pytest.mark.parametrize("name", NOT_FREE["threads"])
def test_threads_native(name):
    """Native twin: the wide single-row RMSNorm, a reduction torch splits over threads, changes with the
    thread count on every CPU (about 1 row in 6 on the CPUs seen)."""
    fn, n = CASES[name]
    with rk.mode("native"):
        bad = sum(not same_bits(a, b) for a, b in _one_and_two_threads(fn, n, alone=n))
    assert bad > 0, f"native {name}: 1 vs 2 threads gave the same bits for every wide row"
