"""Native twin of the strict tests: plain vLLM (its own Qwen3 and CPU kernels, post-temperature
log-probs) on the same checkpoint, prompts and engine settings. Its returned logprobs do not equal
the reference's teacher-forcing logprobs bit for bit: the strict property is not free. Also: a native
engine takes new weights, repeatedly, through vLLM's weight-update API (last: it changes the weights)."""

from __future__ import annotations

import pytest
import torch
from vllm_test_utils import ENGINE_ARGS, compare_with_reference, make_prompts, running_llm

from rl_kernel.bits import same_bits
from rl_kernel.integrations.vllm import native_llm_kwargs, native_sampling_params, push_weights

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
    assert result["mismatches"] == result["tokens"], result  # every token differs, as README's table says


def _prompt_logprobs(llm, prompts: list[list[int]]) -> torch.Tensor:
    """The engine's logprob of every prompt token after the first (teacher forcing inside vLLM: no
    sampling, so two calls with the same weights see the same inputs), one flat fp32 tensor."""
    params = native_sampling_params(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor(
        [step[tok].logprob for p, o in zip(prompts, outs) for step, tok in zip(o.prompt_logprobs[1:], p[1:])],
        dtype=torch.float32,
    )


def _buckets(weights: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """HF-named tensors in buckets of `size` tensors: q/k/v and gate/up of a layer (fused in vLLM's
    model) land in different buckets, so one layer's weights arrive over several chunks."""
    names = sorted(weights)
    return [{n: weights[n] for n in names[i : i + size]} for i in range(0, len(names), size)]


def test_native_engine_serves_pushed_weights(llm, reference):
    """vLLM's own model takes new weights through the weight-update API (rl_kernel_cpu engine, vLLM's
    layerwise reload redoing its post-load weight processing), repeatedly: after each push the
    engine reports the version and serves the pushed weights (its logprobs move, and sit closer to
    the reference model's with the pushed weights than with the previous ones); pushing the original
    weights back gives the original logprobs bit for bit."""
    from rl_kernel.integrations.vllm import finish_weight_update, send_weights, worker_weight_versions

    def perturb(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {n: (w.float() + 0.02 * torch.randn(w.shape, generator=g)).to(w.dtype) for n, w in original.items()}

    def distance(got: torch.Tensor, weights: dict[str, torch.Tensor]) -> float:
        ref = Qwen3Reference.from_pretrained(tiny_qwen3_path)
        ref.load_hf_weights(weights, strict=True)
        want = torch.cat(ref.sequence_logprobs(prompts, [1] * len(prompts)))
        return float((got.double() - want.double()).abs().max())

    from rl_kernel.models.qwen3 import Qwen3Reference

    tiny_qwen3_path = llm.llm_engine.model_config.model
    original = reference.state_dict_hf()
    prompts = make_prompts(6, seed=5)
    before = _prompt_logprobs(llm, prompts)
    served = original
    for version, weights in ((1, perturb(1)), (2, perturb(2))):
        llm.start_weight_update()
        for bucket in _buckets(weights, size=2):
            send_weights(llm, bucket, version)
        finish_weight_update(llm, version)
        assert worker_weight_versions(llm) == [version] and llm.get_weight_version() == str(version)
        now = _prompt_logprobs(llm, prompts)
        to_new, to_old = distance(now, weights), distance(now, served)
        print(
            f"native v{version}: max |diff| vs reference with the pushed weights {to_new:.3e}, "
            f"with the previous weights {to_old:.3e}"
        )
        assert not torch.equal(now, before), f"version {version}: the engine's logprobs did not move"
        assert to_new < to_old, f"version {version}: the engine does not serve the pushed weights"
        served = weights

    push_weights(llm, original, version=3)
    assert worker_weight_versions(llm) == [3]
    after = _prompt_logprobs(llm, prompts)
    assert same_bits(after, before), (
        f"original weights pushed back: max |diff| {float((after - before).abs().max()):.3e} from the first run"
    )
