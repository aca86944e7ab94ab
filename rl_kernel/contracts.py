"""Numeric execution contracts.

A contract pins, for one op on one backend, the six behaviours that decide its output bits:
input dependency, partition of the reduction domain, merge order, precision, rounding points and
arithmetic primitives. Its fingerprint covers those terms and the source of the code that serves
it, so two runs whose contracts share a fingerprint compute every output element by the same
sequence of IEEE operations (the same bits on the same device type), and a kernel change that keeps
the prose still changes the fingerprint.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.util
import json
from collections.abc import Callable
from typing import Any

# Imports under these prefixes are followed when a contract's sources are hashed: the op modules and the
# kernels they call. Other rl_kernel modules (modes, evidence, errors) decide no bit.
_FOLLOWED = ("rl_kernel.ops", "rl_kernel.backends.")


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
    sources: tuple[str, ...] = ()  # modules whose code serves the contract (op module, kernel module)

    @property
    def id(self) -> str:
        """Stable, human-readable id: `rl_kernel.<op>.<backend>.v<version>`."""
        return f"rl_kernel.{self.op}.{self.backend}.v{self.version}"

    @functools.cached_property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of every term and parameter and of the source text of every
        module `sources` reach (see `source_digests`): a change of prose, parameter, kernel, constant or
        launch table changes it. Module names do not enter it, only their text."""
        terms = {k: v for k, v in dataclasses.asdict(self).items() if k != "sources"}
        blob = json.dumps(terms, sort_keys=True, default=str) + "".join(source_digests(self.sources))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> str:
        lines = [f"{self.id}  [{self.fingerprint}]"]
        for field in ("input_dependency", "partition", "merge_order", "precision", "rounding", "primitives"):
            lines.append(f"  {field:17s} {getattr(self, field)}")
        if self.params:
            lines.append(f"  {'params':17s} {dict(self.params)}")
        if self.sources:
            lines.append(f"  {'sources':17s} {', '.join(self.sources)} (and the rl_kernel modules they import)")
        return "\n".join(lines)


def _find(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


@functools.cache
def _module_source(name: str) -> tuple[str, tuple[str, ...]]:
    """(SHA-256 of the module's source file, the followed modules it imports, at any depth of its code)."""
    spec = _find(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"contract source {name!r}: no Python source file")
    with open(spec.origin, "rb") as f:
        text = f.read()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(_FOLLOWED)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(_FOLLOWED):
            found.append(node.module)
            package = _find(node.module)
            if package is not None and package.submodule_search_locations is not None:  # names may be modules
                found += [f"{node.module}.{a.name}" for a in node.names if _find(f"{node.module}.{a.name}")]
    return hashlib.sha256(text).hexdigest(), tuple(found)


def source_digests(modules: tuple[str, ...]) -> list[str]:
    """The sorted, distinct SHA-256 digests of the source files of `modules`, of the rl_kernel op and backend
    modules they import (transitively, lazy imports included) and of those modules' packages under
    rl_kernel.backends (e.g. the Triton package, which fixes cuBLASLt's workspace)."""
    seen, todo = set(), list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += _module_source(name)[1]
        if name.startswith("rl_kernel.backends.") and name.count(".") > 2:
            todo.append(name.rsplit(".", 1)[0])
    return sorted({_module_source(name)[0] for name in seen})


_REGISTRY: dict[str, Contract] = {}
# Functions giving contracts in force at this process's settings (deployment-dependent ones), added by the
# layer that knows the ops (`rl_kernel.ops.spec`): this module sits below the ops and imports none of them.
_IN_FORCE: list[Callable[[], dict[str, Contract]]] = []


def register(contract: Contract) -> Contract:
    _REGISTRY[contract.id] = contract
    return contract


def add_in_force(source: Callable[[], dict[str, Contract]]) -> None:
    """Make `all_contracts` include `source()` (id -> contract), resolved at each call."""
    _IN_FORCE.append(source)


def all_contracts() -> dict[str, Contract]:
    """Every strict contract this process knows, by id: the registered ones, and every op's contracts in
    force at this process's settings (a deployment-dependent one, such as the Triton GEMM's K groups at
    `rl_kernel.set_canonical_tp`, whether or not this process has run it: a CPU-only driver checks the
    contracts GPU engines ran)."""
    found = dict(_REGISTRY)
    for source in _IN_FORCE:
        found |= source()
    return found


def native(op: str, framework: str = "torch") -> Contract:
    """The pseudo-contract recorded for native runs: it promises nothing beyond the framework's kernels."""
    return Contract(
        op,
        f"native-{framework}",
        0,
        "framework-defined",
        "framework-defined",
        "framework-defined",
        "framework-defined",
        "framework-defined",
        "framework-defined",
    )
