"""A native twin of the router's slowness on the H200: a pairwise tree built from reshapes makes Triton 3.6
compute the whole [16, 128] block in every thread.

    python tests/ops/sm90_replicated_tree.py layouts   the sm_90 TTGIR of each launch: tensors held whole by
                                                        every thread (tests/gpu/compile_checks.py)
    TRITON_INTERPRET=1 python tests/ops/sm90_replicated_tree.py run   both trees' bits against the torch tree

Each prints one JSON object. `reshape` is the router's old form: exp64 of a [16, 128] block, then
`numerics.tree_sum` (reshape to [R, W/2, 2] and split, seven times); Triton 3.6 gave the block a layout with
every element in every thread's registers and rematerialised the exp64 chain there (2,048 exp64 per thread:
652 us a router call at batch 64 on the H200, 2026-12-04). `butterfly` is the same block through
`numerics.tree_sum_lanes`, as the router now sums. The trees' bits are the same (the `run` mode).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from rl_kernel.backends.torch import numerics as torch_numerics
from rl_kernel.backends.triton.numerics import exp64, tree_sum, tree_sum_lanes

ROWS, LOG2_W = 16, 7


@triton.jit
def tree_kernel(x_ptr, out_ptr, BUTTERFLY: tl.constexpr, ROWS: tl.constexpr, LOG2_W: tl.constexpr):
    """out[r, :] = e / (the pairwise tree of e), e = exp64(x[r, :]) rounded to fp32 (the router's softmax), the
    tree by the form BUTTERFLY names."""
    r = tl.arange(0, ROWS)
    lane = tl.arange(0, 1 << LOG2_W)
    x = tl.load(x_ptr + r[:, None] * (1 << LOG2_W) + lane[None, :])
    e = exp64(x.to(tl.float64)).to(tl.float32)
    s = tree_sum_lanes(e, LOG2_W) if BUTTERFLY else tree_sum(e, LOG2_W)
    offs = r[:, None] * (1 << LOG2_W) + lane[None, :]
    tl.store(out_ptr + offs, tl.div_rn(e, s[:, None]))


def _tree(butterfly: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(ROWS, 1 << LOG2_W, generator=torch.Generator().manual_seed(0)) * 4
    out = torch.empty(ROWS, 1 << LOG2_W, dtype=torch.float32)
    tree_kernel[(1,)](x, out, BUTTERFLY=butterfly, ROWS=ROWS, LOG2_W=LOG2_W)
    return x, out


def launches() -> dict[str, Callable[[], object]]:
    return {
        "reshape": lambda: _tree(False),
        "butterfly": lambda: _tree(True),
    }


def main(mode: str) -> dict:
    if mode == "layouts":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
        from compile_checks import run_checks

        return {"triton": triton.__version__, "records": run_checks("layouts", launches=launches())}
    bits = {}
    for name, butterfly in (("reshape", False), ("butterfly", True)):
        x, out = _tree(butterfly)
        e = torch_numerics.exp64(x.double()).float()
        want = e / torch_numerics.tree_sum(e)[:, None]
        bits[name] = bool(torch.equal(out.view(torch.int32), want.view(torch.int32)))
    return {"triton": triton.__version__, "kernel_type": type(tree_kernel).__name__, "equal_to_torch_tree": bits}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
