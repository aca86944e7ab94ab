"""Numeric execution contracts.

A contract pins, for one op on one backend, the six behaviours that decide its output bits:
input dependency, partition of the reduction domain, merge order, precision, rounding points and
arithmetic primitives. Two runs whose contracts share a fingerprint compute every output element
by the same sequence of IEEE operations, so they give the same bits on the same device type.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class Contract:
    op: str
    backend: str
    version: int
    input_dependency: str
    partition: str
    merge_order: str
    precision: str
    rounding: str
    primitives: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def id(self) -> str:
        """Stable, human-readable id: `rl_kernel.<op>.<backend>.v<version>`."""
        return f"rl_kernel.{self.op}.{self.backend}.v{self.version}"

    @functools.cached_property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of every field: any change of behaviour changes it."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> str:
        lines = [f"{self.id}  [{self.fingerprint}]"]
        for field in ("input_dependency", "partition", "merge_order", "precision", "rounding", "primitives"):
            lines.append(f"  {field:17s} {getattr(self, field)}")
        if self.params:
            lines.append(f"  {'params':17s} {dict(self.params)}")
        return "\n".join(lines)


_REGISTRY: dict[str, Contract] = {}


def register(contract: Contract) -> Contract:
    _REGISTRY[contract.id] = contract
    return contract


def all_contracts() -> dict[str, Contract]:
    """Every strict contract this process knows, by id: the registered ones, and those a deployment
    parametrises (the Triton GEMM's K groups) at this process's canonical TP (`rl_kernel.set_canonical_tp`),
    whether or not this process has run them: a CPU-only driver checks the contracts GPU engines ran."""
    from rl_kernel.ops.gemm import deployment_contracts  # ops import this module

    return dict(_REGISTRY) | deployment_contracts()


def native(op: str, framework: str = "torch") -> Contract:
    """The pseudo-contract recorded for native runs: it promises nothing beyond the framework's kernels."""
    return Contract(op, f"native-{framework}", 0, "framework-defined", "framework-defined",
                    "framework-defined", "framework-defined", "framework-defined", "framework-defined")
