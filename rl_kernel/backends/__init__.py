"""Backend selection for strict ops.

`torch` runs everywhere (CPU and CUDA) and is the reference; `triton` runs on CUDA. The choice is
`auto` by default (triton on CUDA where it implements the op, else torch) and can be pinned with
`set_backend` or `RL_KERNEL_BACKEND`. A pinned backend that cannot run an op raises: strict mode
never falls back silently.
"""

from __future__ import annotations

import os

import torch as _torch  # not `torch`: the subpackage rl_kernel.backends.torch would shadow it

from rl_kernel.backends import triton as _triton  # noqa: F401  (claims cuBLASLt's workspace, see there)
from rl_kernel.errors import StrictModeError

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("RL_KERNEL_BACKEND", "auto")


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown rl_kernel backend {name!r}; choose one of {BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


def triton_ops() -> frozenset[str]:
    """The ops the Triton backend implements on this machine (empty without CUDA or Triton)."""
    if not _torch.cuda.is_available():
        return frozenset()
    try:
        from rl_kernel.backends.triton import IMPLEMENTED
    except ImportError:
        return frozenset()
    return IMPLEMENTED


def strict_backend(op: str, device: _torch.device) -> str:
    """The backend that runs `op` on `device` in strict mode, or StrictModeError naming why none can."""
    if _backend == "torch":
        return "torch"
    if _backend == "triton":
        if device.type != "cuda":
            raise StrictModeError(op, "triton", f"tensors are on {device.type}; the Triton backend needs CUDA")
        if op not in triton_ops():
            raise StrictModeError(op, "triton", "no Triton kernel for this op (pin RL_KERNEL_BACKEND=torch)")
        return "triton"
    if device.type == "cuda" and op in triton_ops():
        return "triton"
    return "torch"
