"""What the strict vLLM GPU tests share: the prompt set, starting and closing an engine, reading its sampled
logprobs, and counting bit mismatches."""

from __future__ import annotations

import os

import pytest
import torch

from rl_kernel.bits import bits


def shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Lengths 1..~620; two in three share one of two long prefixes (prefix caching has work to do)."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(10, 150_000, (m,), generator=g).tolist() for m in (300, 180)]
    out = []
    for i in range(n):
        tail = torch.randint(10, 150_000, (int(torch.randint(1, 320, (1,), generator=g)),), generator=g).tolist()
        out.append(prefixes[i % 2] + tail if i % 3 else tail)
    return out


def start_engine(**kwargs):
    """An engine with vLLM's multiprocess core (one process per engine: two engines of one process cannot both
    capture CUDA graphs in vLLM 0.26). A test's own CUDA IPC handles reach that core only as pickles (vLLM's
    msgpack refuses them; same-process IPC is refused by CUDA), hence the opt-in below."""
    vllm = pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    return vllm.LLM(**kwargs)


def close_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    torch.cuda.empty_cache()


def sampled(outputs) -> tuple[list[list[int]], torch.Tensor]:
    """Each request's sampled tokens and the fp32 logprob of every one (Python floats hold the fp32 values exactly)."""
    tokens, logprobs = [], []
    for out in outputs:
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        tokens.append(list(c.token_ids))
        logprobs.extend(step[t].logprob for step, t in zip(c.logprobs, c.token_ids))
    return tokens, torch.tensor(logprobs, dtype=torch.float32)


def mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements whose raw bits differ (the shapes must agree and hold something)."""
    assert got.shape == want.shape and got.numel() > 0
    return int((bits(got) != bits(want)).sum())
