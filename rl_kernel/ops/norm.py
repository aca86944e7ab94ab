"""Norm boundary: RMSNorm, with the fused residual form of vLLM and Megatron.

Strict contract (torch backend): the residual sum x + residual is taken in x's dtype (one
rounding) and is what gets normalised; the sum of squares is fp32 in blocks of 64 over the last
dim (pairwise tree inside a block, blocks left to right); mean = sum / D; r = 1 / sqrt(mean + eps)
(IEEE div and sqrt); y = round(round(x * r) * w) - rounded to x's dtype before and after the weight,
as the HF Qwen3 / vLLM kernels do.
"""

from __future__ import annotations

import torch

from rl_kernel import backends
from rl_kernel.backends.torch import norm as torch_norm
from rl_kernel.contracts import Contract, register
from rl_kernel.ops._common import check_float, is_strict, record_native, strict_contract

CONTRACTS = {
    "torch": register(Contract(
        op="rms_norm", backend="torch", version=2,
        input_dependency="y[t, :] depends on x[t, :] (+ residual[t, :]), weight, eps",
        partition="last dim in blocks of 64, last block zero-padded",
        merge_order="pairwise tree inside a block, blocks left to right",
        precision="fp32 sum of squares, mean, inverse rms",
        rounding="residual sum in x's dtype; x*r rounded to x's dtype; times weight rounded to x's dtype",
        primitives="IEEE mul, add, div; correctly rounded sqrt (rl_kernel sqrt32); 1/sqrt (not rsqrt)",
    )),
    "triton": register(Contract(
        op="rms_norm", backend="triton", version=1,
        input_dependency="y[t, :] depends on x[t, :] (+ residual[t, :]), weight, eps",
        partition="last dim in blocks of 64, last block zero-padded",
        merge_order="pairwise tree inside a block, blocks left to right",
        precision="fp32 sum of squares, mean, inverse rms",
        rounding="residual sum in x's dtype; x*r rounded to x's dtype; times weight rounded to x's dtype",
        primitives="IEEE mul, add, div_rn, sqrt_rn; no FMA (fp fusion off): the torch contract's operations",
    )),
}


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


class _StrictRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        contract = strict_contract("rms_norm", x.device, CONTRACTS)
        check_float("rms_norm", contract.backend, x, weight)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        if contract.backend == "triton":
            from rl_kernel.backends.triton.norm import rms_norm as triton_rms_norm
            return triton_rms_norm(x, weight, eps)
        return torch_norm.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_y):
        """No bit contract: one Triton pass on CUDA, autograd through fp32 RMSNorm elsewhere."""
        x, weight = ctx.saved_tensors
        if x.is_cuda and "rms_norm" in backends.triton_ops():
            from rl_kernel.backends.triton.norm import rms_norm_backward
            gx, gw = rms_norm_backward(x, weight, grad_y, ctx.eps)
            return gx, gw, None
        with torch.enable_grad():
            x_ = x.detach().to(torch.float32).requires_grad_()
            w_ = weight.detach().to(torch.float32).requires_grad_()
            y = _native_rms_norm(x_, w_, ctx.eps)
            gx, gw = torch.autograd.grad(y, (x_, w_), grad_y.to(torch.float32))
        return gx.to(x.dtype), gw.to(weight.dtype), None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim. With `residual`, normalises s = x + residual and returns (y, s)."""
    if residual is not None:
        x = x + residual
    if is_strict("norm"):
        y = _StrictRMSNorm.apply(x, weight, eps)
    else:
        record_native("rms_norm", x.device)
        y = _native_rms_norm(x, weight, eps)
    return y if residual is None else (y, x)
