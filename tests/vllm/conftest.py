"""vLLM integration tests: skipped where vLLM is not installed; the reference model fixture."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="session")
def reference(tiny_qwen3_path):
    """rl_kernel's reference Qwen3 (strict, TP1) over the tiny checkpoint the engines load."""
    from rl_kernel.models.qwen3 import Qwen3Reference

    return Qwen3Reference.from_pretrained(tiny_qwen3_path)
