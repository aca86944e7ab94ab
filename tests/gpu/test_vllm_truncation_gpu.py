"""Exact top-k / top-p / min-p on the strict vLLM engine on CUDA, against rl_kernel teacher forcing (issue 38, item 8;
needs vLLM built for CUDA; skipped without).

One strict engine (CUDA graphs of decode batches, prefix caching on, chunked prefill) samples, in one `generate`,
requests of Qwen3-8B-shaped layers (random weights) under five truncations side by side in the same batches:
top_k=20 + top_p=0.9 (the issue's pair), top_p=0.8, top_k=50, top_p=0.95 + min_p=0.05, and none (the full
softmax), at two temperatures. Every sampled token's logprob is compared, in fp32 bits, with
`Qwen3Reference.sequence_logprobs` of the same tokens under the same truncation (the trainer's rebuild of the support
from its own strict logits): 0 mismatches, and every sampled token inside the trainer's support. Against the full
softmax the truncated rows differ on every token (by the log of the support mass). Native twin: native vLLM with its
own top_k / top_p / min_p returns the logprob of its renormalised support: against the full softmax a trainer scores
it differs on every token, by about the log of the support mass (not kernel noise).

    python -m pytest tests/gpu/test_vllm_truncation_gpu.py -q    (on a GPU machine with vLLM; about 60 s on an H200)
"""

from __future__ import annotations

import os

import pytest
import torch

from rl_kernel.bits import bits
from rl_kernel.ops.truncation import Truncation
from tests.gpu.engine_tools import close_engine as _close
from tests.gpu.engine_tools import sampled
from tests.gpu.engine_tools import start_engine as _llm

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

LAYERS = int(os.environ.get("VIME_GPU_TEST_LAYERS", "2"))
SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128)
TRUNCATIONS = (
    Truncation(top_k=20, top_p=0.9),
    Truncation(top_p=0.8),
    Truncation(top_k=50),
    Truncation(top_p=0.95, min_p=0.05),
    Truncation(),  # off: the full softmax, in the same batches as the truncated rows
)
TEMPERATURES = (1.0, 0.7)
PER_GROUP, NEW_TOKENS = 12, 24  # 12 requests x 24 tokens per truncation: 288 tokens each, 1440 in all
ENGINE = dict(
    dtype="bfloat16",
    seed=0,
    max_model_len=512,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    enable_prefix_caching=True,
    block_size=16,
    gpu_memory_utilization=0.3,
)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 1..~260 tokens; every other one starts with one shared 120-token prefix."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(10, vocab - 10, (120,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(10, vocab - 10, (int(torch.randint(1, 140, (1,), generator=g)),), generator=g).tolist()
        out.append(prefix + tail if i % 2 else tail)
    return out


def requests(vocab: int) -> list[tuple[list[int], float, Truncation]]:
    """(prompt, temperature, truncation) per request, the truncations interleaved so every batch mixes them."""
    prompts = _prompts(PER_GROUP * len(TRUNCATIONS), vocab)
    return [
        (p, TEMPERATURES[(i // len(TRUNCATIONS)) % len(TEMPERATURES)], TRUNCATIONS[i % len(TRUNCATIONS)])
        for i, p in enumerate(prompts)
    ]


def returned(outputs) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(generated ids per request, the engine's fp32 logprob of every generated token per request)."""
    ids, flat = sampled(outputs)
    return ids, list(flat.split([len(t) for t in ids]))


def teacher_forced(reference, reqs, ids, truncation_of_group) -> dict[Truncation, tuple[torch.Tensor, torch.Tensor]]:
    """Per truncation group present in `reqs`: (the request tokens' reference logprobs under
    `truncation_of_group(t)`, packed in reverse order in one varlen batch per group, and the same tokens'
    full-softmax logprobs), both fp32 on CPU."""
    out = {}
    for t in TRUNCATIONS:
        members = [i for i, r in enumerate(reqs) if r[2] == t]
        if not members:
            continue
        seqs = [reqs[i][0] + ids[i] for i in members][::-1]
        lens = [len(reqs[i][0]) for i in members][::-1]
        temps = [reqs[i][1] for i in members][::-1]
        under = reference.sequence_logprobs(seqs, lens, temps, truncation_of_group(t))[::-1]
        full = reference.sequence_logprobs(seqs, lens, temps)[::-1]
        out[t] = (torch.cat(under).float().cpu(), torch.cat(full).float().cpu())
    return out


def group(reqs, got: list[torch.Tensor], t: Truncation) -> torch.Tensor:
    return torch.cat([g for r, g in zip(reqs, got) if r[2] == t])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rl_kernel.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(
        tmp_path_factory.mktemp("qwen3_8b_layers_trunc"), num_layers=LAYERS, device="cuda", init_std=0.02, **SHAPE
    )


@pytest.fixture(scope="module")
def reference(model_path):
    from rl_kernel.models.qwen3 import Qwen3Reference

    return Qwen3Reference.from_pretrained(model_path, device="cuda")


def strict_run(model_path, vocab: int = SHAPE["vocab_size"], device: str = "cuda", engine: dict = ENGINE) -> dict:
    """The strict engine's run (graphs on): requests, generated ids, per-request logprobs."""
    from rl_kernel.integrations.vllm import strict_llm_kwargs, strict_sampling_params

    reqs = requests(vocab)
    llm = _llm(**strict_llm_kwargs(model_path, device=device, **engine))
    try:
        params = [strict_sampling_params(temp, NEW_TOKENS, ignore_eos=True, truncation=t) for _, temp, t in reqs]
        ids, got = returned(llm.generate([{"prompt_token_ids": p} for p, _, _ in reqs], params, use_tqdm=False))
    finally:
        _close(llm)
    return {"reqs": reqs, "ids": ids, "got": got}


def native_run(model_path, vocab: int = SHAPE["vocab_size"], device: str = "cuda", engine: dict = ENGINE) -> dict:
    """The native twin: vLLM's own model, kernels and top_k / top_p / min_p (eager: the sampler is the same)."""
    from rl_kernel.integrations.vllm import native_llm_kwargs, native_sampling_params

    reqs = [r for r in requests(vocab) if r[2].active]
    llm = _llm(**native_llm_kwargs(model_path, device=device, enforce_eager=True, **engine))
    try:
        params = [
            native_sampling_params(temp, NEW_TOKENS, ignore_eos=True, top_k=t.top_k, top_p=t.top_p, min_p=t.min_p)
            for _, temp, t in reqs
        ]
        ids, got = returned(llm.generate([{"prompt_token_ids": p} for p, _, _ in reqs], params, use_tqdm=False))
    finally:
        _close(llm)
    return {"reqs": reqs, "ids": ids, "got": got}


@pytest.fixture(scope="module")
def strict(model_path):
    return strict_run(model_path)


def check_strict(run: dict, reference) -> dict[Truncation, int]:
    """Per truncation: mismatches against teacher forcing under it (asserted 0 by the caller), with the support
    and full-softmax properties asserted here."""
    want = teacher_forced(reference, run["reqs"], run["ids"], lambda t: t if t.active else None)
    mismatches = {}
    for t in TRUNCATIONS:
        got, (under, full) = group(run["reqs"], run["got"], t), want[t]
        assert got.shape == under.shape and got.numel() == PER_GROUP * NEW_TOKENS
        assert bool(torch.isfinite(under).all()), f"{t}: a sampled token lies outside the trainer's support"
        mismatches[t] = int((bits(got) != bits(under)).sum())
        if t.active:
            assert bool((bits(got) != bits(full)).all()), f"{t}: the full softmax must differ on every token"
            assert bool((got >= full).all()), f"{t}: renormalising over a support can only raise a logprob"
        print(f"strict {t}: {got.numel()} tokens, {mismatches[t]} mismatches")
    return mismatches


def test_strict_truncated_sampling_equals_teacher_forcing_in_bits(strict, reference):
    mismatches = check_strict(strict, reference)
    assert mismatches == dict.fromkeys(TRUNCATIONS, 0)


def check_native(run: dict, reference) -> dict[Truncation, int]:
    """Native vLLM's processed logprobs (after its top-k / top-p / min-p) against the full softmax a trainer scores:
    they differ on every token, and by the support's renormalisation, not kernel noise: the median gap to the
    full softmax is at least half the exact one (-log of the support mass, the reference's, on the same tokens)."""
    want = teacher_forced(reference, run["reqs"], run["ids"], lambda t: t)
    differ = {}
    for t in TRUNCATIONS[:-1]:
        got, (under, full) = group(run["reqs"], run["got"], t), want[t]
        assert got.shape == full.shape and got.numel() == PER_GROUP * NEW_TOKENS
        differ[t] = int((bits(got) != bits(full)).sum())
        gap, exact = float((got - full).median()), float((under - full).median())
        print(f"native {t} vs full softmax: {differ[t]} / {got.numel()} differ; gap {gap:.4f} (exact {exact:.4f}) nats")
        assert differ[t] == got.numel(), f"{t}: native's renormalised logprob equals the full softmax somewhere"
        assert exact > 0 and gap >= 0.5 * exact, f"{t}: native's gap {gap} is not the support's renormalisation"
    return differ


def test_native_twin_truncated_logprobs_differ_from_the_full_softmax(model_path, reference):
    check_native(native_run(model_path), reference)
