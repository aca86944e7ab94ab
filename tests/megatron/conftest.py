"""Fixtures for the Megatron tests: one spawned gloo world per world size, shared by the tests.

Each fixture starts real processes (torch.multiprocessing spawn, gloo), runs megatron-core in them
and returns rank 0's results; the tests then compare raw fp32 bits in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import megatron_workers by name

pytest.importorskip("megatron.core")


def _spawn(tmp_path_factory: pytest.TempPathFactory, ckpt: Path, world: int, jobs: list[dict]) -> dict:
    from megatron_workers import spawn

    return spawn(world, jobs, ckpt, tmp_path_factory.mktemp(f"megatron_world{world}") / "results.pt")


@pytest.fixture(scope="session")
def world1(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_path: Path) -> dict:
    jobs = [
        {"tp": 1, "cp": 1, "modes": ("strict", "native"), "packings": True, "export": True, "train": True, "gspo": True}
    ]
    return _spawn(tmp_path_factory, tiny_qwen3_path, 1, jobs)


@pytest.fixture(scope="session")
def world2(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_path: Path) -> dict:
    jobs = [
        {"tp": 2, "cp": 1, "modes": ("strict", "native"), "export": True, "train": True},
        {"tp": 1, "cp": 2, "modes": ("strict", "native"), "packings": True, "gspo": True},
    ]
    return _spawn(tmp_path_factory, tiny_qwen3_path, 2, jobs)


@pytest.fixture(scope="session")
def world4(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_path: Path) -> dict:
    jobs = [{"tp": 2, "cp": 2, "modes": ("strict", "native"), "train": True}]
    return _spawn(tmp_path_factory, tiny_qwen3_path, 4, jobs)


@pytest.fixture(scope="session")
def moe_world1(tmp_path_factory: pytest.TempPathFactory, tiny_moe_path: Path) -> dict:
    jobs = [{"tp": 1, "cp": 1, "modes": ("strict", "native"), "export": True, "train": True, "routes": True}]
    return _spawn(tmp_path_factory, tiny_moe_path, 1, jobs)
