"""The asynchronous loop's kept weight versions in pinned host memory (`trainer.kept_on=host`): bit copies of the
trainer's CUDA weights, written into an expired version's buffers rather than newly pinned ones."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from rl_kernel.bits import same_bits  # noqa: E402
from vime.trainer.actor import to_pinned_host  # noqa: E402


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(1000, 256, generator=g, device="cuda").bfloat16(),
        "model.norm.weight": torch.randn(256, generator=g, device="cuda").bfloat16(),
    }


def test_kept_host_copies_are_pinned_bit_copies_and_reuse_expired_buffers():
    first = to_pinned_host(_weights(0), None)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in first.values())
    assert all(same_bits(first[k], v.cpu()) for k, v in _weights(0).items())
    buffers = {k: t.data_ptr() for k, t in first.items()}
    second = to_pinned_host(_weights(1), first)  # version 0 expired: its buffers take version 1
    assert {k: t.data_ptr() for k, t in second.items()} == buffers
    assert all(same_bits(second[k], v.cpu()) for k, v in _weights(1).items())
    other = {"model.norm.weight": torch.zeros(128, dtype=torch.bfloat16, device="cuda")}
    assert to_pinned_host(other, second)["model.norm.weight"].shape == (128,)  # another shape: new buffers
