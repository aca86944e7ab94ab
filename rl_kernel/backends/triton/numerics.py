"""Triton twins of `rl_kernel.backends.torch.numerics`: the same IEEE operations in the same order.

Every kernel that uses these is launched with `enable_fp_fusion=False`, so a mul followed by an add
stays two correctly rounded operations (no FMA), as in the torch backend. fp64 constants are built
with `tl.full(..., tl.float64)`: a bare Python float in a Triton kernel is an fp32 literal.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LAUNCH = {"enable_fp_fusion": False}  # every rl_kernel Triton kernel is launched with these options

INV_LN2 = tl.constexpr(1.0 / math.log(2.0))
LN2_HI = tl.constexpr(6.93147180369123816490e-01)
LN2_LO = tl.constexpr(1.90821492927058770002e-10)
SQRT2 = tl.constexpr(math.sqrt(2.0))
PIO2_1 = tl.constexpr(1.57079632673412561417e00)  # pi/2 in three parts (Cody-Waite), as torch's sincos64
PIO2_2 = tl.constexpr(6.07710050630396597660e-11)
PIO2_3 = tl.constexpr(2.02226624871116645580e-21)
TWO_OVER_PI = tl.constexpr(2.0 / math.pi)
SN = [tl.constexpr((-1.0) ** k / math.factorial(2 * k + 1)) for k in range(11, -1, -1)]  # sin Horner
CS = [tl.constexpr((-1.0) ** k / math.factorial(2 * k)) for k in range(11, -1, -1)]  # cos Horner
(SN0, SN1, SN2, SN3, SN4, SN5, SN6, SN7, SN8, SN9, SN10, SN11) = SN
(CS0, CS1, CS2, CS3, CS4, CS5, CS6, CS7, CS8, CS9, CS10, CS11) = CS
E = [tl.constexpr(1.0 / math.factorial(k)) for k in range(13, -1, -1)]  # exp Horner, highest first
L = [tl.constexpr(2.0 / (2 * k + 1)) for k in range(12, -1, -1)]  # log Horner, highest first
(E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10, E11, E12, E13) = E
(L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11, L12) = L


@triton.jit
def f64(v: tl.constexpr):
    return tl.full((), v, tl.float64)


@triton.jit
def exp64(x):
    """exp of fp64 x: Cody-Waite reduction and a degree-13 Taylor polynomial, as torch's exp64."""
    n = tl.floor(x * f64(INV_LN2) + f64(0.5))
    n = tl.minimum(tl.maximum(n, f64(-1022.0)), f64(1023.0))
    r = (x - n * f64(LN2_HI)) - n * f64(LN2_LO)
    acc = tl.zeros_like(r) + f64(E0)
    acc = acc * r + f64(E1)
    acc = acc * r + f64(E2)
    acc = acc * r + f64(E3)
    acc = acc * r + f64(E4)
    acc = acc * r + f64(E5)
    acc = acc * r + f64(E6)
    acc = acc * r + f64(E7)
    acc = acc * r + f64(E8)
    acc = acc * r + f64(E9)
    acc = acc * r + f64(E10)
    acc = acc * r + f64(E11)
    acc = acc * r + f64(E12)
    acc = acc * r + f64(E13)
    pow2 = ((n.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    y = acc * pow2
    y = tl.where(x < f64(-700.0), f64(0.0), y)
    y = tl.where(x > f64(709.7), f64(float("inf")), y)
    return tl.where(x != x, x, y)


@triton.jit
def log64(x):
    """Natural log of positive normal fp64 x, as torch's log64 (callers pass sums >= 1)."""
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)
    big = m > f64(SQRT2)
    m = tl.where(big, m * f64(0.5), m)
    ef = (e + big.to(tl.int64)).to(tl.float64)
    s = (m - f64(1.0)) / (m + f64(1.0))  # fp64 division is IEEE (div.rn.f64)
    s2 = s * s
    acc = tl.zeros_like(s2) + f64(L0)
    acc = acc * s2 + f64(L1)
    acc = acc * s2 + f64(L2)
    acc = acc * s2 + f64(L3)
    acc = acc * s2 + f64(L4)
    acc = acc * s2 + f64(L5)
    acc = acc * s2 + f64(L6)
    acc = acc * s2 + f64(L7)
    acc = acc * s2 + f64(L8)
    acc = acc * s2 + f64(L9)
    acc = acc * s2 + f64(L10)
    acc = acc * s2 + f64(L11)
    acc = acc * s2 + f64(L12)
    log_m = acc * s
    return ef * f64(LN2_HI) + (ef * f64(LN2_LO) + log_m)


@triton.jit
def _horner12(x, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11):
    acc = tl.zeros_like(x) + c0
    acc = acc * x + c1
    acc = acc * x + c2
    acc = acc * x + c3
    acc = acc * x + c4
    acc = acc * x + c5
    acc = acc * x + c6
    acc = acc * x + c7
    acc = acc * x + c8
    acc = acc * x + c9
    acc = acc * x + c10
    acc = acc * x + c11
    return acc


@triton.jit
def sincos64(x):
    """(sin x, cos x) of fp64 x >= 0 (|x| < 2**20 pi/2), as torch's sincos64: three-part Cody-Waite reduction by
    pi/2 and degree-23 / 22 polynomials in Horner form."""
    k = tl.floor(x * f64(TWO_OVER_PI) + f64(0.5))
    r = ((x - k * f64(PIO2_1)) - k * f64(PIO2_2)) - k * f64(PIO2_3)
    r2 = r * r
    s = _horner12(
        r2, f64(SN0), f64(SN1), f64(SN2), f64(SN3), f64(SN4), f64(SN5), f64(SN6), f64(SN7), f64(SN8), f64(SN9),
        f64(SN10), f64(SN11),
    ) * r  # fmt: skip
    c = _horner12(
        r2, f64(CS0), f64(CS1), f64(CS2), f64(CS3), f64(CS4), f64(CS5), f64(CS6), f64(CS7), f64(CS8), f64(CS9),
        f64(CS10), f64(CS11),
    )  # fmt: skip
    q = k.to(tl.int64) % 4  # k >= 0
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    return sin, cos


@triton.jit
def tree_sum(x, LOG2_WIDTH: tl.constexpr):
    """Pairwise tree of neighbours over the last dim of an [R, 2**LOG2_WIDTH] block: element 2i plus
    element 2i+1 until one is left, as torch's `tree_sum`. Returns [R]."""
    for i in tl.static_range(LOG2_WIDTH):
        x = tl.reshape(x, (x.shape[0], (1 << LOG2_WIDTH) >> (i + 1), 2))
        a, b = tl.split(x)
        x = a + b
    return tl.reshape(x, (x.shape[0],))


@triton.jit
def tree_sum_lanes(x, LOG2_WIDTH: tl.constexpr):
    """`tree_sum`'s bits over the last dim of an [R, 2**LOG2_WIDTH] block, by a butterfly: at level i every
    lane adds the lane 2**i apart (lane ^ 2**i), so after the levels each lane holds its row's tree, the upper
    half of every pair having added the same two values in the other order (IEEE addition commutes exactly).
    Returns [R]. Unlike `tree_sum`'s reshapes, the block keeps its layout: the compiler never computes the
    caller's [R, W] block with every element in every thread (Triton 3.6 did that for the router: 16 x 128
    exp64 per thread, 652 us a call on the H200)."""
    lane = tl.zeros(x.shape, tl.int32) + tl.arange(0, 1 << LOG2_WIDTH)[None, :]
    for i in tl.static_range(LOG2_WIDTH):
        x = x + tl.gather(x, lane ^ (1 << i), axis=1)
    return tl.max(x, axis=1)  # every lane holds the same value
