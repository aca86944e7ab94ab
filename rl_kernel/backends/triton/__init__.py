"""Triton backend of rl_kernel (CUDA): strict kernels under their own contracts (backend "triton").

Importing this package needs neither CUDA nor Triton; the kernel modules (gemm, norm, activation,
rope, attention, logprob) import Triton and are loaded by the ops when the backend runs.

It also claims cuBLASLt's workspace at import (`import rl_kernel` does this): the GEMM contract's one
K chain is served by cuBLASLt at large M only when cuBLASLt cannot choose split-K, and a 1 KiB
workspace leaves it no split-K kernel. torch reads `CUBLASLT_WORKSPACE_SIZE` once, at its first
cuBLASLt call, so the setting counts only if no CUDA work ran before; `cublaslt_ready()` says
whether it holds. Where it does not, the Triton kernel serves every M (same bits, slower).
"""

from __future__ import annotations

import os
import sys

IMPLEMENTED: frozenset[str] = frozenset(
    {
        "gemm",
        "rms_norm",
        "silu_and_mul",
        "rope",
        "attention",
        "logprobs",
        "log_softmax",
        "gumbel_sample",
        "moe_router",
        "moe_experts",
        "moe_combine",
    }
)
CUBLASLT_WORKSPACE_KIB = "1"


def _claim_cublaslt_workspace() -> bool:
    if os.environ.get("RL_KERNEL_CUBLASLT", "1") == "0":
        return False
    preset = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    if preset is not None:
        return preset == CUBLASLT_WORKSPACE_KIB
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False  # a cuBLASLt call may already have fixed torch's workspace size
    os.environ["CUBLASLT_WORKSPACE_SIZE"] = CUBLASLT_WORKSPACE_KIB
    return True


_CUBLASLT_READY = _claim_cublaslt_workspace()


def cublaslt_ready() -> bool:
    """True when cuBLASLt runs in this process with a workspace that excludes split-K."""
    return _CUBLASLT_READY
