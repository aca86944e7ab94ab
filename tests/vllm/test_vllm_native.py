"""Native twin of the strict tests: plain vLLM (its own Qwen3 and CPU kernels, post-temperature
log-probs) on the same checkpoint, prompts and engine settings. Its returned logprobs do not equal
the reference's teacher-forcing logprobs bit for bit: the strict property is not free."""

from __future__ import annotations

import pytest
from vllm_test_utils import ENGINE_ARGS, compare_with_reference, make_prompts, running_llm

from rl_kernel.integrations.vllm import native_llm_kwargs, native_sampling_params

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    with running_llm(**native_llm_kwargs(tiny_qwen3_path, **ENGINE_ARGS)) as engine:
        yield engine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_native_logprobs_differ_from_reference(llm, reference, temperature):
    prompts = make_prompts(32, seed=32 * 10 + int(temperature * 10))
    params = native_sampling_params(temperature=temperature, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = compare_with_reference(outputs, prompts, [temperature] * 32, reference)
    print(f"native T={temperature} batch=32: {result}")
    assert result["tokens"] == 32 * 12
    assert result["mismatches"] > 0, result
