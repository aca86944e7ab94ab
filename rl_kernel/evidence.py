"""A record of what ran: op, mode, backend, contract id and fingerprint, with call counts.

Engines report `snapshot()` so that a comparison between two sides can check that both ran the
same contracts, and that no native kernel ran on a strict forward path.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator

from rl_kernel.contracts import Contract


@dataclasses.dataclass(frozen=True)
class OpRecord:
    op: str
    mode: str
    backend: str
    contract_id: str
    fingerprint: str
    device_type: str


_counts: collections.Counter[OpRecord] = collections.Counter()


def record(contract: Contract, mode: str, device_type: str) -> None:
    _counts[OpRecord(contract.op, mode, contract.backend, contract.id, contract.fingerprint, device_type)] += 1


def _order(item: tuple[OpRecord, int]) -> tuple:
    """Records in a fixed order (op, mode, backend, ...), whatever ran earlier in the process."""
    return dataclasses.astuple(item[0])


def snapshot() -> list[dict]:
    """Everything recorded since the last `reset()`, one dict per distinct record, with `calls`."""
    return [dataclasses.asdict(r) | {"calls": n} for r, n in sorted(_counts.items(), key=_order)]


def reset() -> None:
    _counts.clear()


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
    """`with recording() as ran:` fills `ran` with the records of the ops the block ran."""
    before = collections.Counter(_counts)
    ran: list[dict] = []
    try:
        yield ran
    finally:
        delta = _counts - before
        ran.extend(dataclasses.asdict(r) | {"calls": n} for r, n in sorted(delta.items(), key=_order))


def native_ops(records: list[dict]) -> list[dict]:
    """The records among `records` that ran in native mode (what a strict engine must not show)."""
    return [r for r in records if r["mode"] != "strict"]
