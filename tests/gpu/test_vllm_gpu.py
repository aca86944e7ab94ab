"""The strict vLLM engine on CUDA, against rl_kernel teacher forcing (needs vLLM built for CUDA; skipped without).

One strict engine (CUDA graphs of decode batches, prefix caching on, chunked prefill under a small token budget,
a KV cache small enough to force preemptions) samples 96 sequences of Qwen3-8B-shaped layers (random weights);
every sampled token's logprob is compared, in fp32 bits, with `Qwen3Reference.sequence_logprobs` of the same
tokens packed in one varlen batch. The same engine then takes new weights over CUDA IPC (rl_kernel's push into
vLLM's own `ipc` weight-transfer engine) and is compared again, against a reference holding the new weights. An
eager engine re-scores the graph engine's tokens by forced decoding: the same bits. A native engine (vLLM's own
model, kernels, torch.compile and graphs) differs.

    python -m pytest tests/gpu/test_vllm_gpu.py -q     (on a GPU machine with vLLM; VIME_GPU_TEST_LAYERS=N)
"""

from __future__ import annotations

import os

import pytest
import torch

from rl_kernel.integrations.vllm import STRICT_CUDA_BLOCK_SIZE
from tests.gpu.engine_tools import close_engine as _close
from tests.gpu.engine_tools import mismatches as _mismatches
from tests.gpu.engine_tools import sampled as _tokens_and_logprobs
from tests.gpu.engine_tools import shared_prefix_prompts
from tests.gpu.engine_tools import start_engine as _llm

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

LAYERS = int(os.environ.get("VIME_GPU_TEST_LAYERS", "2"))
SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128)
PROMPTS, NEW_TOKENS, TEMPERATURE = 96, 32, 0.8
ENGINE = dict(
    dtype="bfloat16",
    seed=0,
    max_model_len=1024,
    max_num_seqs=64,
    max_num_batched_tokens=256,
    enable_prefix_caching=True,
    gpu_memory_utilization=0.5,
    disable_log_stats=False,
)
SMALL_KV_BLOCKS = 5120 // STRICT_CUDA_BLOCK_SIZE  # 5,120 slots for 96 sequences of up to ~700 tokens: vLLM preempts


def _prompts(n: int = PROMPTS, seed: int = 0) -> list[list[int]]:
    return shared_prefix_prompts(n, seed)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(
        tmp_path_factory.mktemp("qwen3_8b_layers"), num_layers=LAYERS, device="cuda", init_std=0.02, **SHAPE
    )


@pytest.fixture(scope="module")
def reference(model_path):
    from rl_kernel.models.qwen3 import Qwen3Reference

    return Qwen3Reference.from_pretrained(model_path, device="cuda")


def _teacher_forcing(reference, prompts, tokens) -> torch.Tensor:
    """The reference's logprobs of the same tokens, all sequences in one varlen pack (reverse order)."""
    seqs = [p + t for p, t in zip(prompts, tokens)]
    lens = [len(p) for p in prompts]
    want = reference.sequence_logprobs(seqs[::-1], lens[::-1], TEMPERATURE)[::-1]
    return torch.cat(want).float().cpu()


def _metric(llm, name: str) -> float:
    return sum(float(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def graph_run(model_path, reference):
    """The strict CUDA-graph engine's run: its tokens and logprobs before and after an IPC weight update."""
    from rl_kernel.integrations.vllm import strict_llm_kwargs, strict_sampling_params, worker_evidence

    prompts = _prompts()
    llm = _llm(**strict_llm_kwargs(model_path, device="cuda", num_gpu_blocks_override=SMALL_KV_BLOCKS, **ENGINE))
    try:
        params = [
            strict_sampling_params(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, seed=i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        tokens, logprobs = _tokens_and_logprobs(
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        )
        run = {
            "prompts": prompts,
            "tokens": tokens,
            "logprobs": logprobs,
            "preemptions": _metric(llm, "vllm:num_preemptions"),
            "prefix_hits": _metric(llm, "vllm:prefix_cache_hits"),
            "evidence": [r for worker in worker_evidence(llm) for r in worker],
        }
        run["updated"] = _update_over_ipc(llm, model_path, reference, prompts, params)
    finally:
        _close(llm)
    return run


def _update_over_ipc(llm, model_path, reference, prompts, params) -> dict:
    """Push new weights (every tensor changed) as version 1 over CUDA IPC, generate again; the reference is
    given the same weights."""
    from rl_kernel.integrations.vllm.ipc import VllmIPCReceiver
    from rl_kernel.models.qwen3 import load_hf_state_dict, read_config
    from rl_kernel.weights.transfer import WeightSender, expected_weights

    old = load_hf_state_dict(model_path)
    gen = torch.Generator(device="cuda").manual_seed(7)
    new = {
        n: (t.to("cuda", torch.float32) * (1 + 0.05 * torch.rand(t.shape, generator=gen, device="cuda"))).to(
            torch.bfloat16
        )
        for n, t in old.items()
    }
    receiver = VllmIPCReceiver(llm, expected_weights(read_config(model_path), "bfloat16"), version=0)
    acks: list = []
    sender = WeightSender("ipc", lambda msg: acks.append(receiver.handle(msg)), lambda: acks[-1])
    pushed = sender.push(new.items(), 1)
    reference.load_hf_weights(new)
    tokens, logprobs = _tokens_and_logprobs(
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    )
    from rl_kernel.integrations.vllm.compat import get_weight_version

    return {
        "ack": pushed,
        "served": get_weight_version(llm),
        "tokens": tokens,
        "logprobs": logprobs,
        "want": _teacher_forcing(reference, prompts, tokens),
    }


def test_strict_vllm_matches_teacher_forcing_bit_for_bit(graph_run, reference, model_path):
    """0 mismatches over every sampled token, with preemptions and prefix-cache hits in the run."""
    from rl_kernel.models.qwen3 import load_hf_state_dict

    assert graph_run["preemptions"] > 0, "the small KV cache did not force a preemption"
    assert graph_run["prefix_hits"] > 0, "prefix caching reused nothing"
    reference.load_hf_weights(load_hf_state_dict(model_path))  # the run's weights (the fixture then updated them)
    want = _teacher_forcing(reference, graph_run["prompts"], graph_run["tokens"])
    assert _mismatches(graph_run["logprobs"], want) == 0


def test_triton_contracts_ran_in_the_engine(graph_run):
    ran = graph_run["evidence"]
    assert ran and all(r["mode"] == "strict" for r in ran), ran
    assert {r["backend"] for r in ran} == {"triton"}, ran
    assert {"gemm", "rms_norm", "rope", "attention", "silu_and_mul", "log_softmax"} <= {r["op"] for r in ran}, ran
    assert all(r["device_type"] == "cuda" for r in ran), ran


def test_weight_update_over_ipc_then_parity_under_the_new_weights(graph_run):
    updated = graph_run["updated"]
    assert updated["ack"]["version"] == 1 and int(updated["served"]) == 1
    assert _mismatches(updated["logprobs"], updated["want"]) == 0
    before = graph_run["logprobs"]
    n = min(before.numel(), updated["logprobs"].numel())
    assert _mismatches(updated["logprobs"][:n], before[:n]) > 0, "the new weights changed nothing"


def test_eager_engine_rescores_the_graph_engine_tokens_in_the_same_bits(graph_run, model_path, reference):
    """Forced decoding of the graph run's tokens (version 0 weights) on an eager engine: every logprob equal."""
    from rl_kernel.integrations.vllm import forced_sampling_params, strict_llm_kwargs

    llm = _llm(
        **strict_llm_kwargs(
            model_path,
            device="cuda",
            enforce_eager=True,
            **{k: v for k, v in ENGINE.items() if k != "disable_log_stats"},
        )
    )
    try:
        params = [forced_sampling_params(t, temperature=TEMPERATURE) for t in graph_run["tokens"]]
        tokens, logprobs = _tokens_and_logprobs(
            llm.generate([{"prompt_token_ids": p} for p in graph_run["prompts"]], params, use_tqdm=False)
        )
    finally:
        _close(llm)
    assert tokens == graph_run["tokens"]
    assert _mismatches(logprobs, graph_run["logprobs"]) == 0


def _fresh_run(engine_kwargs: dict, make_params, prompts, model_path, reference) -> tuple[torch.Tensor, torch.Tensor]:
    """One engine's sampled logprobs of `prompts` (a seed per request) and teacher forcing of its tokens under the
    checkpoint's weights (the graph run's fixture updated the reference's)."""
    from rl_kernel.models.qwen3 import load_hf_state_dict

    llm = _llm(**engine_kwargs)
    try:
        params = [
            make_params(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, seed=i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        tokens, logprobs = _tokens_and_logprobs(
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        )
    finally:
        _close(llm)
    reference.load_hf_weights(load_hf_state_dict(model_path))
    return logprobs, _teacher_forcing(reference, prompts, tokens)


def test_compiled_strict_engine_matches_teacher_forcing(model_path, reference, monkeypatch):
    """The compiled strict engine (compile=True: vLLM's torch.compile of the strict model, FULL_AND_PIECEWISE graphs
    split at the strict attention op, so mixed prefill + decode steps replay piecewise graphs): every sampled
    token's fp32 bits equal teacher forcing, under the same chunked prefill, preemptions and prefix reuse.

    On 6d6ff51 748 of 1,536 differed: the attention op returned a new tensor, which the next piecewise graph read
    at its capture address. vLLM's debug level makes every graph replay assert that its inputs sit where they did
    at capture, so a regression of that kind fails here by name."""
    from rl_kernel.integrations.vllm import strict_llm_kwargs, strict_sampling_params

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # CUDAGraphWrapper's input-address check at every replay
    kwargs = strict_llm_kwargs(model_path, device="cuda", compile=True, **ENGINE)
    got, want = _fresh_run(kwargs, strict_sampling_params, _prompts(48, seed=2), model_path, reference)
    assert _mismatches(got, want) == 0


def test_native_twin_differs_from_teacher_forcing(model_path, reference):
    from rl_kernel.integrations.vllm import native_llm_kwargs, native_sampling_params

    kwargs = native_llm_kwargs(model_path, device="cuda", **ENGINE)
    got, want = _fresh_run(kwargs, native_sampling_params, _prompts(32, seed=1), model_path, reference)
    assert _mismatches(got, want) > 0


def test_vllm_cache_write_lands_the_same_bytes_as_write_kv():
    """vLLM's one-kernel FlashAttention cache write (what the strict model uses on CUDA) against rl_kernel's
    `write_kv`, on a batch with padding slots (-1) and scattered slots: the caches equal byte for byte."""
    from types import SimpleNamespace

    from rl_kernel.integrations.vllm.model import _vllm_cache_writer, kv_cache_views, write_kv, write_kv_flash

    pytest.importorskip("vllm")
    writer = _vllm_cache_writer()
    assert writer is not None
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks, block, kv_heads, d, tokens = 64, 16, 8, 128, 40
    raw = torch.randn(blocks, block, kv_heads, 2 * d, generator=gen, device="cuda").to(torch.bfloat16)
    caches = [raw.permute(0, 2, 1, 3).clone(memory_format=torch.preserve_format) for _ in range(2)]
    k = torch.randn(tokens, kv_heads, d, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(tokens, kv_heads, d, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(blocks * block, generator=gen, device="cuda")[:tokens].to(torch.int64)
    slots[-5:] = -1  # vLLM's padding
    scale = SimpleNamespace(_k_scale=torch.ones((), device="cuda"), _v_scale=torch.ones((), device="cuda"))
    write_kv(k, v, *kv_cache_views(caches[0], "FLASH_ATTN", d), slots)
    write_kv_flash(writer, scale, k, v, *kv_cache_views(caches[1], "FLASH_ATTN", d), slots)
    torch.cuda.synchronize()
    assert torch.equal(caches[0].view(torch.int16), caches[1].view(torch.int16))
    assert not torch.equal(caches[0].view(torch.int16), raw.permute(0, 2, 1, 3).view(torch.int16))
