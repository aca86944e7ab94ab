"""Activation boundary: SwiGLU, `silu(x[..., :I]) * x[..., I:]`.

Strict contract (torch backend): elementwise in fp32; silu(g) = g / (1 + exp(-g)) with rl_kernel's
exp (fp64 Cody-Waite + polynomial, rounded to fp32); the product rounded once to x's dtype.
No intermediate is materialised in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_kernel import backends
from rl_kernel.ops import library
from rl_kernel.ops.spec import OpSpec


def native_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


ACTIVATION = OpSpec(
    "silu_and_mul",
    "activation",
    __name__,
    native=native_silu_and_mul,
    kernels={"torch": "rl_kernel.backends.torch.activation", "triton": "rl_kernel.backends.triton.activation"},
)
_TERMS = dict(
    input_dependency="out[..., i] depends on x[..., i] and x[..., I + i] only",
    partition="none (elementwise)",
    merge_order="none (elementwise)",
    precision="fp32 gate, up, silu and product",
    rounding="product rounded once to x's dtype",
)
ACTIVATION.contract(
    "torch",
    1,
    **_TERMS,
    primitives="exp: rl_kernel exp64 (Cody-Waite + degree-13 polynomial, fp64) rounded to fp32; IEEE add, div, mul",
)
ACTIVATION.contract(
    "triton",
    1,
    **_TERMS,
    primitives="exp: rl_kernel exp64 ported to Triton (fp64, no FMA) rounded to fp32; IEEE add, div_rn, mul",
)


class _StrictSiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _, kernels = ACTIVATION.strict(x.device, x)
        ctx.save_for_backward(x)
        return kernels.silu_and_mul(x)

    @staticmethod
    def backward(ctx, grad_out):
        """No bit contract: one Triton pass on CUDA, fp32 torch elsewhere."""
        (x,) = ctx.saved_tensors
        if x.is_cuda and "silu_and_mul" in backends.triton_ops():
            from rl_kernel.backends.triton.activation import silu_and_mul_backward

            return silu_and_mul_backward(x, grad_out)
        half = x.shape[-1] // 2
        g, u = x[..., :half].to(torch.float32), x[..., half:].to(torch.float32)
        sig = torch.sigmoid(g)
        dout = grad_out.to(torch.float32)
        grad_g = dout * u * sig * (1.0 + g * (1.0 - sig))
        grad_u = dout * g * sig
        return torch.cat([grad_g, grad_u], dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] in x's dtype."""
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _silu_and_mul_op(x)
    return ACTIVATION(_StrictSiluAndMul.apply, x)


# ---- the op as one opaque node for torch.compile (rl_kernel.ops.library) ----


@torch.library.custom_op(f"{library.LIB}::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x).contiguous()


@_silu_and_mul_op.register_fake
def _silu_and_mul_fake(x):
    return library.like(x, *x.shape[:-1], x.shape[-1] // 2)
