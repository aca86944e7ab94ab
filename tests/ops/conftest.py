"""Fixtures for the rl_kernel op tests.

Every test starts in strict mode (whatever RL_KERNEL_MODE says) on the process's backend and thread
count, and gets the process's modes, backend and thread count back afterwards.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel as rk


@pytest.fixture(autouse=True)
def _rl_kernel_state():
    modes, backend, threads = rk.current_modes(), rk.get_backend(), torch.get_num_threads()
    rk.set_mode("strict")
    yield
    for boundary, name in modes.items():
        rk.set_mode(name, boundary)
    rk.set_backend(backend)
    torch.set_num_threads(threads)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: every test draws the same inputs on every run."""
    return torch.Generator().manual_seed(0)
