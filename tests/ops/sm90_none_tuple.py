"""A native twin of the bug a6b2b3b fixed: a `@triton.jit` helper returns a tuple holding a `None` argument.

    python tests/ops/sm90_none_tuple.py compile   compile both launches for sm_90 (tests/gpu/compile_checks.py)
    TRITON_INTERPRET=1 python tests/ops/sm90_none_tuple.py run   run both launches under the interpreter

Each prints one JSON object, launch name to its result. The attention kernel's `_keys` packed absent TMA
descriptors and block table (None) into such a tuple: Triton 3.9 and the interpreter accept it, the GPU image's
Triton 3.6 refuses to compile it ("cannot convert None ... to tensor"). `none` passes None, `stand_in` passes a
tensor in its place (the fix), so a refusal of `none` is the None's doing. tests/ops/test_sm90_compile.py runs it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

N = 16


@triton.jit
def _pack(x_ptr, extra):
    """The tuple of `_keys`: a pointer and an argument that may be None (never read)."""
    return x_ptr, extra


@triton.jit
def none_tuple_kernel(x_ptr, out_ptr, extra, N: tl.constexpr):
    """out = 2 * x, x's pointer taken from the packed tuple."""
    packed = _pack(x_ptr, extra)
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(packed[0] + offs) * 2)


def _launch(extra_is_none: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(N, dtype=torch.float32)
    out = torch.zeros(N, dtype=torch.float32)
    none_tuple_kernel[(1,)](x, out, None if extra_is_none else x, N=N)
    return x, out


def launches() -> dict[str, Callable[[], object]]:
    return {"none": lambda: _launch(True), "stand_in": lambda: _launch(False)}


def main(mode: str) -> dict:
    if mode == "compile":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
        from compile_checks import run_checks

        return {"triton": triton.__version__, "records": run_checks(launches=launches())}
    outputs = {name: launch() for name, launch in launches().items()}
    ran = {name: bool(torch.equal(out, 2 * x)) for name, (x, out) in outputs.items()}
    return {"triton": triton.__version__, "kernel_type": type(none_tuple_kernel).__name__, "ran": ran}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
