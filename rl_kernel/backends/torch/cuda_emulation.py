"""CUDA ATen's division by a host scalar, reproduced on CPU, to check the torch backend's bits on CUDA here.

On CUDA, torch computes `a / b` with b a host scalar (a Python number, or a one-element CPU tensor) as
`a * (1 / b)`, 1 / b rounded once in a's op-math type (fp32 for fp32 / bf16 / fp16, fp64 for fp64) and the
product rounded again (ATen's BinaryDivTrueKernel.cu: "this may lose one bit of precision"). On CPU the
same expression is one IEEE division. The two agree when 1 / b is exact (b a power of two) and differ
in the last bit for a fraction of inputs otherwise (D = 1100: about 8% of fp32 quotients), so torch
backend code that divides by a Python number has CPU bits that its CUDA run does not reproduce.

`CudaScalarDivision` is a dispatch mode that, inside its `with` block, runs every such division the way
CUDA does (on CPU tensors), and records each one it rewrote in `.seen` (op, numerator shape, divisor).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DIVS = {torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor, torch.ops.aten.div.Scalar, torch.ops.aten.div_.Scalar}
_OPMATH = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _host_scalar(b: object) -> float | None:
    """b's value when b is a Python number (a host scalar on every device), else None. A 0-dim CPU tensor is one
    too on CUDA, but on CPU it cannot be told from a 0-dim tensor made on the data's device: not rewritten."""
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return float(b)
    return None


class CudaScalarDivision(TorchDispatchMode):
    """Float tensor / host scalar computed as CUDA ATen does: a * fl(1 / b), in a's op-math type, rounded to a's
    dtype. Other ops run unchanged. `.seen` lists (op name, numerator shape, divisor) of every division rewritten."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...], float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DIVS and not kwargs.get("rounding_mode") and len(args) == 2:
            a, b = args
            value = _host_scalar(b)
            if isinstance(a, torch.Tensor) and a.dtype.is_floating_point and value is not None:
                self.seen.append((str(func), tuple(a.shape), value))
                opmath = _OPMATH.get(a.dtype, a.dtype)
                inv = torch.ones((), dtype=opmath) / torch.full((), value, dtype=opmath)
                out = (a.to(opmath) * inv).to(a.dtype)
                return a.copy_(out) if func in (torch.ops.aten.div_.Tensor, torch.ops.aten.div_.Scalar) else out
        return func(*args, **kwargs)
