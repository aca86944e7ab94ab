"""What every op does before it computes: find its mode and backend, and record what ran."""

from __future__ import annotations

import torch

from rl_kernel import backends, evidence
from rl_kernel.contracts import Contract, native
from rl_kernel.errors import StrictModeError
from rl_kernel.modes import get_mode

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_strict(boundary: str) -> bool:
    return get_mode(boundary) == "strict"


def record_native(op: str, device: torch.device, framework: str = "torch") -> None:
    evidence.record(native(op, framework), "native", device.type)


def strict_contract(op: str, device: torch.device, contracts: dict[str, Contract]) -> Contract:
    """The contract `op` runs under on `device` (recorded), or StrictModeError when none can run."""
    backend = backends.strict_backend(op, device)
    if backend not in contracts:
        raise StrictModeError(op, backend, "no strict implementation on this backend")
    contract = contracts[backend]
    evidence.record(contract, "strict", device.type)
    return contract


def check_float(op: str, backend: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in FLOAT_DTYPES:
            raise StrictModeError(op, backend, f"dtype {t.dtype} is outside the contract ({FLOAT_DTYPES})")
