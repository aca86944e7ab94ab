"""Triton backend of rl_kernel (CUDA): strict kernels under their own contracts (backend "triton").

Importing this package needs neither CUDA nor Triton; the kernel modules (gemm, norm, activation,
rope, attention, logprob) import Triton and are loaded by the ops when the backend runs.
"""

IMPLEMENTED: frozenset[str] = frozenset({"gemm", "rms_norm", "silu_and_mul", "rope", "attention", "logprobs"})
