"""Plugin wiring and request validation without an engine (fast): registration through vLLM's own
registries, engine arguments, strict request checks, and the clear error for non-Qwen3 checkpoints."""

from __future__ import annotations

import json

import pytest
from vllm import SamplingParams

import rl_kernel as rk
from rl_kernel.integrations.vllm import (
    ARCH,
    FORCED_TOKENS_KEY,
    MODES_KEY,
    SAMPLER_KEY,
    TEMPERATURE_KEY,
    TP_COLLECTIVE_KEY,
    WEIGHT_TRANSFER_BACKEND,
    register,
    strict_llm_kwargs,
    strict_sampling_params,
)
from rl_kernel.integrations.vllm.sampling import StrictLogprobsProcessor

pytestmark = pytest.mark.vllm


def test_entry_point_registers_model_and_weight_transfer_engine():
    from importlib.metadata import entry_points

    from vllm import ModelRegistry
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rl_kernel"]
    assert ep.load() is register
    register()
    register()  # vLLM may load plugins more than once per process
    assert ARCH in ModelRegistry.get_supported_archs()
    assert WEIGHT_TRANSFER_BACKEND in WeightTransferEngineFactory._registry


def test_strict_llm_kwargs(tiny_qwen3_path):
    kwargs = strict_llm_kwargs(tiny_qwen3_path, tensor_parallel_size=2)
    assert kwargs["hf_overrides"] == {"architectures": [ARCH]}
    assert kwargs["logprobs_mode"] == "processed_logits"
    assert kwargs["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="logprobs_mode='processed_logits'"):
        strict_llm_kwargs(tiny_qwen3_path, logprobs_mode="raw_logprobs")


def test_strict_llm_kwargs_carry_every_boundarys_mode(tiny_qwen3_path):
    """Modes reach the engine's processes in its config, every boundary named: strict unless given."""
    assert strict_llm_kwargs(tiny_qwen3_path)["additional_config"] == {
        MODES_KEY: dict.fromkeys(rk.BOUNDARIES, "strict"),
        TP_COLLECTIVE_KEY: "device",  # the TP collectives' path, also decided by the config, not the environment
    }
    kwargs = strict_llm_kwargs(tiny_qwen3_path, {"attention": "native"}, additional_config={"other": 1})
    assert kwargs["additional_config"] == {
        "other": 1,
        MODES_KEY: dict.fromkeys(rk.BOUNDARIES, "strict") | {"attention": "native"},
        TP_COLLECTIVE_KEY: "device",
    }
    with pytest.raises(ValueError, match="boundary 'attn'"):
        strict_llm_kwargs(tiny_qwen3_path, {"attn": "native"})
    with pytest.raises(ValueError, match="mode 'fast'"):
        strict_llm_kwargs(tiny_qwen3_path, {"attention": "fast"})


def test_strict_llm_kwargs_rejects_other_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="Qwen3 dense checkpoints only.*LlamaForCausalLM"):
        strict_llm_kwargs(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        strict_llm_kwargs(tmp_path / "missing")


def test_strict_sampling_params_carry_temperature():
    params = strict_sampling_params(temperature=0.7, max_tokens=3, sampler="vllm", seed=5)
    assert params.temperature == 1.0 and params.extra_args == {TEMPERATURE_KEY: 0.7} and params.logprobs == 0
    assert params.seed == 5  # vLLM's own generator draws
    StrictLogprobsProcessor.validate_params(params)
    with pytest.raises(ValueError, match="temperature > 0"):
        strict_sampling_params(temperature=0.0)


def test_strict_sampling_params_pick_rl_kernels_sampler_where_they_can():
    """auto: rl_kernel's sampler (vLLM's temperature 0: its argmax of the one-hot row) for one sample without
    top-logprobs, seeded from the request's seed; vLLM's sampler for n > 1 or top-logprobs."""
    params = strict_sampling_params(temperature=0.7, max_tokens=3, seed=5)
    assert params.temperature == 0.0 and params.seed is None
    assert params.extra_args == {TEMPERATURE_KEY: 0.7, SAMPLER_KEY: {"seed": 5}}
    StrictLogprobsProcessor.validate_params(params)
    assert strict_sampling_params().extra_args[SAMPLER_KEY] == {"seed": None}  # the worker draws one per request
    for kwargs in ({"n": 2}, {"logprobs": 3}):
        params = strict_sampling_params(temperature=0.7, **kwargs)
        assert params.temperature == 1.0 and SAMPLER_KEY not in params.extra_args
        StrictLogprobsProcessor.validate_params(params)
        with pytest.raises(ValueError, match="sampler='rl_kernel' needs n == 1 and logprobs == 0"):
            strict_sampling_params(sampler="rl_kernel", **kwargs)
    with pytest.raises(ValueError, match="sampler='numpy'"):
        strict_sampling_params(sampler="numpy")


def test_strict_sampling_params_carry_an_exact_truncation():
    from rl_kernel.integrations.vllm import TRUNCATION_KEY, truncation_of
    from rl_kernel.ops.truncation import Truncation

    t = Truncation(top_k=20, top_p=0.9)
    params = strict_sampling_params(temperature=0.7, truncation=t)
    assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)  # vLLM's own stay off
    assert params.extra_args[TRUNCATION_KEY] == {"top_k": 20, "top_p": 0.9, "min_p": 0.0}
    assert truncation_of(params) == t
    StrictLogprobsProcessor.validate_params(params)
    assert TRUNCATION_KEY not in strict_sampling_params(truncation=Truncation()).extra_args  # off: the full softmax
    for bad, message in (({"top_p": 1.5}, "top_p=1.5"), ({"top_k": 20, "typo": 1}, "must be a dict of")):
        params = SamplingParams(logprobs=0, extra_args={TEMPERATURE_KEY: 1.0, TRUNCATION_KEY: bad})
        with pytest.raises(ValueError, match=message):
            StrictLogprobsProcessor.validate_params(params)


_SAMPLED = {TEMPERATURE_KEY: 1.0, SAMPLER_KEY: {"seed": 1}}


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=0.7, logprobs=0), "rl_kernel_temperature'] is missing"),
        (SamplingParams(temperature=0.7, logprobs=0, extra_args={TEMPERATURE_KEY: 0.7}), "temperature=0.7 must be 1.0"),
        (SamplingParams(logprobs=0, extra_args={TEMPERATURE_KEY: -1.0}), "must be a number > 0"),
        (SamplingParams(logprobs=0, top_k=20, extra_args={TEMPERATURE_KEY: 1.0}), "top_k=20"),
        (SamplingParams(logprobs=0, min_p=0.1, extra_args={TEMPERATURE_KEY: 1.0}), "min_p=0.1"),
        (SamplingParams(logprobs=0, logit_bias={3: 1.0}, extra_args={TEMPERATURE_KEY: 1.0}), "logit_bias is set"),
        (SamplingParams(prompt_logprobs=0, extra_args={TEMPERATURE_KEY: 1.0}), "prompt_logprobs is set"),
        (SamplingParams(temperature=0.0, logprobs=0, extra_args={TEMPERATURE_KEY: 1.0}), "temperature=0.0 must be 1.0"),
        (SamplingParams(logprobs=0, extra_args={TEMPERATURE_KEY: 1.0, SAMPLER_KEY: {"seed": 1}}), "must be 0.0 with"),
        (SamplingParams(temperature=0.0, logprobs=2, extra_args=_SAMPLED), "logprobs=2 must be 0 with"),
        (SamplingParams(temperature=0.0, extra_args=_SAMPLED | {FORCED_TOKENS_KEY: [1]}), "exclude each other"),
        (
            SamplingParams(temperature=0.0, extra_args={TEMPERATURE_KEY: 1.0, SAMPLER_KEY: {"seed": "1"}}),
            "{'seed': int or None}",
        ),
    ],
)
def test_strict_processor_rejects(params, message):
    with pytest.raises(ValueError, match=message):
        StrictLogprobsProcessor.validate_params(params)
