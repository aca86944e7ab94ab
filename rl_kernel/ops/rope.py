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
from rl_kernel.ops import library
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


# ---- the op as one opaque node for torch.compile (rl_kernel.ops.library) ----


@torch.library.custom_op(f"{library.LIB}::rope", mutates_args=())
def _rope_op(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None) -> torch.Tensor:
    return rope(x, positions, theta, rotary_dim).contiguous()


@_rope_op.register_fake
def _rope_fake(x, positions, theta, rotary_dim):
    return library.like(x)
