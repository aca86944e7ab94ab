"""Correctly-ordered arithmetic from single IEEE operations.

Every function here is built only from elementwise add, sub, mul, div, sqrt, comparisons,
`where` and integer bit operations. Each of those is correctly rounded, in the vectorised and in
the scalar path of a kernel alike, so an output element's bits depend on its inputs only: not on
the tensor's shape, the element's position, the thread count or the process. Library reductions
(`sum`, `matmul`) and transcendental kernels (`exp`, `log`, `sin`) are not used: their order or
their vector/scalar code path changes with the shape and the threading.
"""

from __future__ import annotations

import math

import torch

REDUCE_BLOCK = 64  # contract: reductions run in blocks of 64 elements

# exp: x = n*ln2 + r, |r| <= ln2/2; exp(r) by a degree-13 Taylor polynomial in Horner form (fp64).
_LN2_HI = 6.93147180369123816490e-01  # ln2 with its low 32 bits zero: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(13, -1, -1)]
# log: x = m * 2^e with m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(s), s = (m-1)/(m+1).
_LOG_COEFFS = [2.0 / (2 * k + 1) for k in range(12, -1, -1)]
# sin/cos: x = k*pi/2 + r, three-part Cody-Waite reduction (fdlibm constants), |r| <= pi/4.
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_SIN_COEFFS = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(11, -1, -1)]
_COS_COEFFS = [(-1.0) ** k / math.factorial(2 * k) for k in range(11, -1, -1)]


def _horner(x: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    acc = torch.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        acc = acc * x + c  # two roundings: torch does not fuse these into an FMA
    return acc


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2**n as float64 for integer n in [-1022, 1023], built from the exponent bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor; relative error about 1e-16; 0 below -700, inf above 709.7."""
    x = x.to(torch.float64)
    n = torch.floor(x * (1.0 / math.log(2.0)) + 0.5).clamp(-1022.0, 1023.0)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    y = _horner(r, _EXP_COEFFS) * _pow2(n)
    y = torch.where(x < -700.0, torch.zeros_like(y), y)
    y = torch.where(x > 709.7, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x), x, y)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """exp with a float32 result: exp64 rounded once to float32."""
    return exp64(x).to(torch.float32)


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of a positive, normal float64 tensor (rl_kernel uses it on sums >= 1)."""
    x = x.to(torch.float64)
    bits = x.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0xFFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # m in [1, 2)
    big = m > math.sqrt(2.0)
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int64)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    log_m = _horner(s * s, _LOG_COEFFS) * s
    y = e * _LN2_HI + (e * _LN2_LO + log_m)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x == math.inf, x, y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, math.nan), y)


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) for float64 x with |x| < 2**20 * pi/2."""
    x = x.to(torch.float64)
    k = torch.floor(x * (2.0 / math.pi) + 0.5)
    r = ((x - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    s = _horner(r2, _SIN_COEFFS) * r
    c = _horner(r2, _COS_COEFFS)
    q = torch.remainder(k.to(torch.int64), 4)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def div_rn(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b with one IEEE rounding in a's dtype on every device, b a Python number. Not `a / b`: CUDA torch
    computes a tensor over a host scalar as a * fl(1 / b), two roundings (ATen's BinaryDivTrueKernel.cu), which
    differs from the IEEE quotient in the last bit for some a unless b is a power of two (1 / b exact); CPU
    torch divides. A divisor tensor on a's device takes the plain division kernel on both."""
    return a / torch.full_like(a, b)


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (torch's CPU sqrt is not: ~16% of fp32 results differ by an
    ulp from IEEE). Start from sqrt in fp64 rounded to fp32, then move to the neighbour whose rounding
    interval holds sqrt(x): the midpoints between neighbouring fp32 values have at most 25 significant
    bits, so their squares are exact in fp64 and the comparisons decide exactly (no ties exist)."""
    x64 = x.to(torch.float64)
    y = torch.sqrt(x64).to(torch.float32)
    up = torch.nextafter(y, torch.full_like(y, math.inf))
    down = torch.nextafter(y, torch.zeros_like(y))
    y64 = y.to(torch.float64)
    mid_up = (y64 + up.to(torch.float64)) * 0.5
    mid_down = (y64 + down.to(torch.float64)) * 0.5
    finite = torch.isfinite(x64) & (x64 > 0)
    y = torch.where(finite & (mid_up * mid_up <= x64), up, y)
    return torch.where(finite & (mid_down * mid_down > x64), down, y)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a balanced pairwise tree of neighbours: zero-pad to a power of two,
    then add element 2i to element 2i+1 until one element is left. Any aligned power-of-two run of
    elements is a subtree, so a shard holding such a run computes an exact node of the full tree."""
    width = x.shape[-1]
    padded = 1 << max(width - 1, 0).bit_length()
    if padded != width:
        x = torch.nn.functional.pad(x, (0, padded - width))
    while x.shape[-1] > 1:
        pairs = x.unflatten(-1, (x.shape[-1] // 2, 2))
        x = pairs[..., 0] + pairs[..., 1]
    return x[..., 0]


def blocked_sum(x: torch.Tensor, block: int = REDUCE_BLOCK) -> torch.Tensor:
    """Sum over the last dim: blocks of `block` elements (the last one zero-padded), a pairwise tree
    inside each block, the block sums added left to right."""
    width = x.shape[-1]
    nblocks = -(-width // block)
    if nblocks <= 1:
        return tree_sum(x)
    if nblocks * block != width:
        x = torch.nn.functional.pad(x, (0, nblocks * block - width))
    sums = tree_sum(x.reshape(*x.shape[:-1], nblocks, block))
    acc = sums[..., 0]
    for i in range(1, nblocks):
        acc = acc + sums[..., i]
    return acc
