"""The reference model on CUDA: rollout/trainer parity there, with the strict backend `auto` picks
(Triton where it implements an op, else torch) and with the torch backend pinned; and the torch
backend's bits on CUDA equal to its bits on the CPU. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
from test_qwen3_rollout import _requests, _teacher_forcing, mismatch_stats

import rl_kernel as rk
from rl_kernel.models import Qwen3Reference
from rl_kernel.models.rollout import RolloutEngine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_rollout_equals_teacher_forcing_cuda(backend, tiny_qwen3_path):
    saved = rk.get_backend()
    rk.set_backend(backend)
    try:
        model = Qwen3Reference.from_pretrained(tiny_qwen3_path, device="cuda")
        reqs = _requests()
        outs = RolloutEngine(model, num_blocks=64, block_size=16, max_num_batched_tokens=13).generate(reqs, seed=3)
        tf = _teacher_forcing(model, reqs, outs)
        with rk.mode("native"):
            native_outs = RolloutEngine(model, num_blocks=64, block_size=16, max_num_batched_tokens=13).generate(
                reqs, seed=3
            )
            native_tf = _teacher_forcing(model, reqs, native_outs)
    finally:
        rk.set_backend(saved)
    bad, n, max_diff = mismatch_stats([o.logprobs.cpu() for o in outs], tf)
    native_bad, _, native_max = mismatch_stats([o.logprobs.cpu() for o in native_outs], native_tf)
    print(f"cuda {backend}: strict {bad} / {n} differ; native {native_bad} / {n} (max |diff| {native_max:.3g})")
    assert n == 54 and bad == 0 and max_diff == 0.0
    assert native_bad > 0  # native twin: cuBLAS / SDPA on the H200 (observed 8 / 54 with the torch backend)


def test_torch_backend_cuda_equals_cpu(tiny_qwen3_path):
    """The torch backend's contract is a fixed sequence of IEEE operations: CUDA gives the CPU's bits."""
    seqs = [r.prompt_ids for r in _requests()]
    prompt_lens = [1] * len(seqs)
    saved = rk.get_backend()
    rk.set_backend("torch")
    try:
        cpu = Qwen3Reference.from_pretrained(tiny_qwen3_path).sequence_logprobs(seqs, prompt_lens)
        cuda = Qwen3Reference.from_pretrained(tiny_qwen3_path, device="cuda").sequence_logprobs(seqs, prompt_lens)
    finally:
        rk.set_backend(saved)
    bad, n, max_diff = mismatch_stats(cpu, cuda)
    print(f"torch backend CPU vs CUDA: {bad} / {n} differ (max |diff| {max_diff:.3g})")
    assert bad == 0
