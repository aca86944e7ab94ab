"""RoPE boundary: Qwen3's rotary embedding (neox layout: the two halves of the rotary dims rotate).

Strict contract (torch backend): inv_freq_i = theta^(-2i/d) = exp(-(2i/d) ln theta) and the angle
pos * inv_freq in fp64 with rl_kernel's exp/log; sin/cos by rl_kernel's fp64 Cody-Waite reduction
and polynomials, rounded to fp32; the rotation x1 cos - x2 sin, x2 cos + x1 sin in fp32 (each
product and the sum rounded, no FMA); the result rounded once to x's dtype. An element depends on
its own position only, so prefill, decode and any chunking give the same bits.
"""

from __future__ import annotations

import weakref

import torch

from rl_kernel import backends
from rl_kernel.backends.torch import rope as torch_rope
from rl_kernel.errors import StrictModeError
from rl_kernel.ops import library
from rl_kernel.ops.norm import NORM, qk_norm
from rl_kernel.ops.spec import OpSpec


def native_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """The framework's RoPE (HF Qwen3): fp32 angles, cos/sin rounded to x's dtype, rotation in x's dtype."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=x.device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype).unsqueeze(-2), emb.sin().to(x.dtype).unsqueeze(-2)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


ROPE = OpSpec(
    "rope",
    "rope",
    __name__,
    native=native_rope,
    kernels={"torch": "rl_kernel.backends.torch.rope", "triton": "rl_kernel.backends.triton.rope"},
)
_TERMS = dict(
    input_dependency="out[t, h, :] depends on x[t, h, :], positions[t], theta, rotary_dim",
    partition="none (elementwise pairs i, i + d/2)",
    merge_order="none",
    rounding="cos/sin to fp32; rotation result rounded once to x's dtype",
)
ROPE.contract(
    "torch",
    1,
    **_TERMS,
    precision="angle and sin/cos in fp64, rounded to fp32; rotation in fp32",
    primitives="rl_kernel exp64/log64/sincos64 (IEEE add/mul/div, no FMA); IEEE fp32 mul, add, sub",
)
ROPE.contract(
    "triton",
    1,
    **_TERMS,
    precision="angle and sin/cos in fp64 (torch backend's table), rounded to fp32; rotation in fp32",
    primitives="rl_kernel exp64/log64/sincos64 (the torch backend's table, or their Triton twins in the kernel); IEEE "
    "fp32 mul, add, sub, no FMA (fp fusion off)",
)


_TABLES: dict[tuple, tuple[weakref.ref, torch.Tensor, torch.Tensor]] = {}


def _cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's fp32 cos/sin of `positions`, reused while the same positions tensor, unmodified, comes
    back (q and k of every layer share it): computing them takes ~100 small elementwise kernels."""
    key = (id(positions), positions._version, positions.device, rotary_dim, float(theta))
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is positions:
        return hit[1], hit[2]
    cos, sin = torch_rope.cos_sin(positions, rotary_dim, theta)
    if len(_TABLES) >= 16:
        _TABLES.clear()
    _TABLES[key] = (weakref.ref(positions), cos, sin)
    return cos, sin


class _StrictRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, theta, rotary_dim):
        _, kernels = ROPE.strict(x.device, x)
        ctx.save_for_backward(positions)
        ctx.rotary_dim, ctx.theta = rotary_dim, theta
        if hasattr(kernels, "rotate_at"):  # Triton: cos/sin computed in the kernel from the positions, same bits
            return kernels.rotate_at(x, positions, theta, rotary_dim)
        cos, sin = _cos_sin(positions, rotary_dim, theta)
        return kernels.rotate(x, cos, sin, rotary_dim)

    @staticmethod
    def backward(ctx, grad_out):
        (positions,) = ctx.saved_tensors
        cos, sin = _cos_sin(positions, ctx.rotary_dim, ctx.theta)
        # The rotation is orthogonal: its adjoint is the rotation by -angle (no bit contract on gradients).
        if grad_out.is_cuda and "rope" in backends.triton_ops():
            from rl_kernel.backends.triton.rope import rotate as triton_rotate

            return triton_rotate(grad_out.contiguous(), cos, -sin, ctx.rotary_dim), None, None, None
        return torch_rope.rotate(grad_out, cos, -sin, ctx.rotary_dim), None, None, None


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate x [T, H, d] (queries or keys) by the angles of `positions` [T] (int, absolute
    positions in the sequence); rotary_dim defaults to d. Returns x's shape and dtype."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _rope_op(x, positions, theta, rotary_dim)
    return ROPE(_StrictRope.apply, x, positions, theta, rotary_dim)


def qk_norm_rope(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_heads: int,
    eps: float,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Qwen3's QK-norm then RoPE of qk [T, q_heads + k_heads, d] (the q and k heads of the fused QKV, a strided
    view) at `positions` [T]: `rope(qk_norm(qk, q_weight, k_weight, q_heads, eps), positions, theta, rotary_dim)`,
    the same bits under both ops' contracts (each recorded as run). One launch where both run strict on Triton and
    no gradient is needed (decode, rollout); the two ops otherwise. Returns a new [T, q_heads + k_heads, d]."""
    rotary_dim = qk.shape[-1] if rotary_dim is None else rotary_dim
    if torch.compiler.is_compiling():  # one opaque node for torch.compile (rl_kernel.ops.library)
        return _qk_norm_rope_op(qk, q_weight, k_weight, q_heads, eps, positions, theta, rotary_dim)
    if _fused_on_triton(qk, q_weight, k_weight):
        NORM.strict(qk.device, qk, q_weight, k_weight)
        _, kernels = ROPE.strict(qk.device, qk)
        return kernels.qk_norm_rope(qk, q_weight, k_weight, q_heads, eps, positions, theta, rotary_dim)
    return rope(qk_norm(qk, q_weight, k_weight, q_heads, eps), positions, theta, rotary_dim)


def _fused_on_triton(*tensors: torch.Tensor) -> bool:
    """Whether the norm and the rope of `tensors` both run strict on Triton, without autograd."""
    if not (NORM.is_strict() and ROPE.is_strict()):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    device = tensors[0].device
    try:
        return all(backends.strict_backend(op, device) == "triton" for op in (NORM.op, ROPE.op))
    except StrictModeError:
        return False  # the two ops raise it themselves, naming op, backend and reason


# ---- the op as one opaque node for torch.compile (rl_kernel.ops.library) ----


@torch.library.custom_op(f"{library.LIB}::rope", mutates_args=())
def _rope_op(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None) -> torch.Tensor:
    return rope(x, positions, theta, rotary_dim).contiguous()


@_rope_op.register_fake
def _rope_fake(x, positions, theta, rotary_dim):
    return library.like(x)


@torch.library.custom_op(f"{library.LIB}::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_heads: int,
    eps: float,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int,
) -> torch.Tensor:
    return qk_norm_rope(qk, q_weight, k_weight, q_heads, eps, positions, theta, rotary_dim).contiguous()


@_qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(qk, q_weight, k_weight, q_heads, eps, positions, theta, rotary_dim):
    return library.like(qk)
