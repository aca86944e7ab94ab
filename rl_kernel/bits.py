"""Raw-bit comparison of float tensors: the one helper every bitwise check uses (rl_kernel's selftest,
vime's consistency metrics, the tests and the benchmarks).

Two values "agree" when their bit patterns are equal, read through an integer view of the same
width: -0.0 and 0.0 differ, a NaN equals only the same NaN payload.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a tensor, as the integer dtype of the same element width."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def _pairs(a, b) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [(a, b)]
    if len(a) != len(b):
        raise ValueError(f"{len(a)} tensors vs {len(b)}")
    return list(zip(a, b))


def bit_mismatches(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """How many elements differ in bits; `a` and `b` are tensors or equal-length sequences of tensors,
    pairwise of the same shape and element width."""
    n = 0
    for x, y in _pairs(a, b):
        if x.shape != y.shape or x.element_size() != y.element_size():
            raise ValueError(f"cannot compare bits of {x.dtype}{list(x.shape)} and {y.dtype}{list(y.shape)}")
        n += int((bits(x) != bits(y)).sum())
    return n


def same_bits(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """True when `a` and `b` (tensors, or equal-length sequences of tensors) have pairwise the same
    shape, dtype and bit pattern in every element."""
    try:
        pairs = _pairs(a, b)
    except ValueError:
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in pairs)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over the elements whose bits differ (inf when a differing element is inf/nan)."""
    differ = bits(a) != bits(b)
    if not bool(differ.any()):
        return 0.0
    d = (a[differ].double() - b[differ].double()).abs()
    return float(torch.nan_to_num(d, nan=math.inf).max())
