"""One way to declare an op: `OpSpec` holds what every op states, so an op module states only what is
particular to it (its contract terms, autograd and native form).

An op names itself (as in its contracts and evidence), the boundary whose mode governs it, its native
(framework) form and, per backend, the module of its strict kernels. `contract(...)` registers the op's
contract on a backend, whose fingerprint covers the op module and that kernel module (see
`rl_kernel.contracts.source_digests`). Calling the spec runs the strict entry or the native form in the
boundary's mode; `strict(...)` picks the backend, checks dtypes, records the contract and returns the
kernel module.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch

from rl_kernel import backends, evidence
from rl_kernel.contracts import Contract, add_in_force, native, register
from rl_kernel.errors import StrictModeError
from rl_kernel.modes import get_mode

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPECS: list[OpSpec] = []  # every op declared (rl_kernel imports all op modules)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    op: str  # the name in contracts and evidence records
    boundary: str  # the mode that governs it (rl_kernel.modes.BOUNDARIES)
    module: str  # the op's module: its dispatch code is part of every contract of the op
    kernels: Mapping[str, str]  # backend -> module of its strict kernels (imported when the backend runs)
    native: Callable[..., Any]  # the framework form
    # backend -> contract, or a function giving the one in force (a contract that depends on the deployment)
    contracts: dict[str, Contract | Callable[[], Contract]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        SPECS.append(self)

    def contract(self, backend: str, version: int, *, params: tuple = (), keep: bool = True, **terms: str) -> Contract:
        """Register the op's contract on `backend` (the six terms of `Contract`, by keyword); its sources are
        the op module and the backend's kernel module. `keep`: also the contract this spec runs there."""
        made = register(
            Contract(self.op, backend, version, params=params, sources=(self.module, self.kernels[backend]), **terms)
        )
        if keep:
            self.contracts[backend] = made
        return made

    def in_force(self) -> dict[str, Contract]:
        """backend -> the contract in force there now (deployment-dependent ones resolved, so registered)."""
        return {b: c if isinstance(c, Contract) else c() for b, c in self.contracts.items()}

    def is_strict(self) -> bool:
        return get_mode(self.boundary) == "strict"

    def __call__(self, strict: Callable[..., Any], *args: Any, native_form: Callable[..., Any] | None = None) -> Any:
        """`strict(*args)` in strict mode; else the native form (`native_form`, default the spec's), recorded on
        the device of the first argument."""
        if self.is_strict():
            return strict(*args)
        self.record_native(args[0].device)
        return (native_form or self.native)(*args)

    def record_native(self, device: torch.device) -> None:
        evidence.record(native(self.op), "native", device.type)

    def strict(self, device: torch.device, *checked: torch.Tensor) -> tuple[Contract, ModuleType]:
        """(contract, kernel module) the op runs under on `device` (the contract recorded as run). Raises
        StrictModeError naming op, backend and reason when no backend can, or a `checked` tensor's dtype is
        outside the contract."""
        backend = backends.strict_backend(self.op, device)
        in_force = self.in_force()
        if backend not in in_force:
            raise StrictModeError(self.op, backend, "no strict implementation on this backend")
        contract = in_force[backend]
        for t in checked:
            if t.dtype not in FLOAT_DTYPES:
                raise StrictModeError(self.op, backend, f"dtype {t.dtype} is outside the contract ({FLOAT_DTYPES})")
        evidence.record(contract, "strict", device.type)
        return contract, importlib.import_module(self.kernels[backend])


def contracts_in_force() -> dict[str, Contract]:
    """Every op's contracts in force in this process, by id (deployment-dependent ones at its settings)."""
    return {c.id: c for spec in SPECS for c in spec.in_force().values()}


add_in_force(contracts_in_force)
