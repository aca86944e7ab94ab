"""Shared fixtures: tiny Qwen3 checkpoints built on the spot (no downloads), and GPU skipping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random bf16 Qwen3 checkpoint + char tokenizer (make_tiny_qwen3 defaults, seed 0)."""
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_fp32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Qwen3 with fp32 weights (for comparisons against HF transformers in fp32/fp64)."""
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_fp32"), dtype="float32")
