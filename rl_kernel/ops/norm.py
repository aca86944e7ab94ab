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
from rl_kernel.ops import library
from rl_kernel.ops.spec import OpSpec


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The framework's RMSNorm (HF Qwen3): fp32 mean of squares, rsqrt, rounded to x's dtype, times weight."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


NORM = OpSpec(
    "rms_norm",
    "norm",
    __name__,
    native=native_rms_norm,
    kernels={"torch": "rl_kernel.backends.torch.norm", "triton": "rl_kernel.backends.triton.norm"},
)
_TERMS = dict(
    input_dependency="y[t, :] depends on x[t, :] (+ residual[t, :]), weight, eps",
    partition="last dim in blocks of 64, last block zero-padded",
    merge_order="pairwise tree inside a block, blocks left to right",
    precision="fp32 sum of squares, mean, inverse rms",
    rounding="residual sum in x's dtype; x*r rounded to x's dtype; times weight rounded to x's dtype",
)
NORM.contract(
    "torch", 2, **_TERMS, primitives="IEEE mul, add, div; correctly rounded sqrt (rl_kernel sqrt32); 1/sqrt (not rsqrt)"
)
NORM.contract(
    "triton",
    1,
    **_TERMS,
    primitives="IEEE mul, add, div_rn, sqrt_rn; no FMA (fp fusion off): the torch contract's operations",
)


class _StrictRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        _, kernels = NORM.strict(x.device, x, weight)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernels.rms_norm(x, weight, eps)

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
            y = native_rms_norm(x_, w_, ctx.eps)
            gx, gw = torch.autograd.grad(y, (x_, w_), grad_y.to(torch.float32))
        return gx.to(x.dtype), gw.to(weight.dtype), None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, in x's dtype. With `residual`, normalises s = x + residual (rounded once
    to x's dtype) and returns (y, s)."""
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _rms_norm_op(x, weight, eps) if residual is None else _rms_norm_residual_op(x, residual, weight, eps)
    if residual is None:
        return NORM(_StrictRMSNorm.apply, x, weight, eps)
    if NORM.is_strict() and not _needs_grad(x, residual, weight):
        _, kernels = NORM.strict(x.device, x, residual, weight)
        return kernels.rms_norm_residual(x, residual, weight, eps)  # one pass: the sum and its norm
    s = x + residual
    return NORM(_StrictRMSNorm.apply, s, weight, eps), s


def qk_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float) -> torch.Tensor:
    """Qwen3's QK-norm of qk [T, q_heads + k_heads, D] (e.g. the q and k heads of the fused QKV, a strided view):
    `rms_norm` of each head, q heads by q_weight, k heads by k_weight; returns a new [T, q_heads + k_heads, D].
    The same bits as two `rms_norm` calls; one launch on Triton where no gradient is needed (decode)."""
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _qk_norm_op(qk, q_weight, k_weight, q_heads, eps)
    if NORM.is_strict() and not _needs_grad(qk, q_weight, k_weight):
        _, kernels = NORM.strict(qk.device, qk, q_weight, k_weight)
        return kernels.rms_norm_heads(qk, q_weight, k_weight, q_heads, eps)
    q, k = qk[:, :q_heads], qk[:, q_heads:]
    return torch.cat([rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)], dim=1)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---- the op as one opaque node for torch.compile (rl_kernel.ops.library) ----


@torch.library.custom_op(f"{library.LIB}::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps).contiguous()


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    return library.like(x)


@torch.library.custom_op(f"{library.LIB}::rms_norm_residual", mutates_args=())
def _rms_norm_residual_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = rms_norm(x, weight, eps, residual=residual)
    return y.contiguous(), s.contiguous()


@_rms_norm_residual_op.register_fake
def _rms_norm_residual_fake(x, residual, weight, eps):
    return library.like(x), library.like(x)


@torch.library.custom_op(f"{library.LIB}::qk_norm", mutates_args=())
def _qk_norm_op(
    qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float
) -> torch.Tensor:
    return qk_norm(qk, q_weight, k_weight, q_heads, eps).contiguous()


@_qk_norm_op.register_fake
def _qk_norm_fake(qk, q_weight, k_weight, q_heads, eps):
    return library.like(qk)
