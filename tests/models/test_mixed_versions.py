"""In-flight weight updates on rl_kernel's paged engine: a request that runs on while the weights change
keeps the K/V its prefix computed under the old version, so its tokens carry mixed versions. The
trainer-side re-scoring (`mixed_version_logprobs`: runs of positions under their own versions over one
paged KV cache) reproduces every token's logprob bit for bit; scoring the whole sequence under one
version (what a teacher-forcing trainer does) does not."""

from __future__ import annotations

import torch

from rl_kernel.bits import bits
from rl_kernel.models import Qwen3Reference
from rl_kernel.models.rollout import Request, RolloutEngine, mixed_version_logprobs, version_segments


def test_version_segments():
    # prompt of 3, response of 4 tokens: token j came from position 2 + j; positions 0..2 with token 0
    assert version_segments(3, [5, 5, 6, 6]) == [(0, 4, 5), (4, 6, 6)]
    assert version_segments(1, [7]) == [(0, 1, 7)]
    assert version_segments(2, [1, 2, 1]) == [(0, 2, 1), (2, 3, 2), (3, 4, 1)]


def _versions(path) -> tuple[Qwen3Reference, dict[int, dict[str, torch.Tensor]]]:
    model = Qwen3Reference.from_pretrained(path, dtype=torch.bfloat16)
    w0 = model.state_dict_hf()
    g = torch.Generator().manual_seed(7)
    w1 = {
        k: (v.float() + 0.05 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in w0.items()
    }
    return model, {0: w0, 1: w1}


def _rollout_with_update(model, weights, update_at: int):
    """Six requests (prefill chunked); before engine step `update_at` (once no prompt is half-computed),
    version 1 lands in flight."""
    g = torch.Generator().manual_seed(3)
    reqs = [
        Request(torch.randint(4, 500, (n,), generator=g).tolist(), 8, temp)
        for n, temp in [(5, 1.0), (19, 0.8), (9, 1.2), (3, 1.0), (12, 1.0), (7, 0.9)]
    ]
    engine = RolloutEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=16)
    state = {"step": 0, "version": 0}

    def between_steps(mid_prefill: bool, sampled: int) -> int:
        if state["version"] == 0 and state["step"] >= update_at and not mid_prefill:
            model.load_hf_weights(weights[1], strict=True)
            state["version"] = 1
        state["step"] += 1
        return state["version"]

    model.load_hf_weights(weights[0], strict=True)
    return reqs, engine.generate(reqs, seed=11, between_steps=between_steps)


def test_mixed_version_sequences_are_reproduced_in_bits(tiny_qwen3_path):
    model, weights = _versions(tiny_qwen3_path)
    reqs, outs = _rollout_with_update(model, weights, update_at=5)
    mixed = [i for i, o in enumerate(outs) if len(set(o.versions)) > 1]
    assert len(mixed) >= 3, [o.versions for o in outs]  # the update really landed inside running requests
    assert all(o.versions == sorted(o.versions) for o in outs)
    load = lambda v: model.load_hf_weights(weights[v], strict=True)  # noqa: E731
    tokens, naive_bad = 0, 0
    for r, o in zip(reqs, outs):
        again = mixed_version_logprobs(model, r.prompt_ids, o.token_ids, o.versions, r.temperature, load)
        assert torch.equal(bits(again), bits(o.logprobs)), (o.versions, again, o.logprobs)
        tokens += len(o.token_ids)
        if len(set(o.versions)) > 1:
            # the twin: the sequence under its newest version alone (teacher forcing) is not what ran
            load(1)
            tf = model.sequence_logprobs([r.prompt_ids + o.token_ids], [len(r.prompt_ids)], r.temperature)[0]
            late = torch.tensor(o.versions) == 1
            naive_bad += int((bits(tf[late]) != bits(o.logprobs[late])).sum())
    assert tokens == 48
    assert naive_bad > 0  # a prefix's K/V under version 0 changes the later tokens' bits: mixing matters


def test_single_version_runs_give_the_teacher_forcing_bits(tiny_qwen3_path):
    """With no update the paged re-score equals teacher forcing: the runs do not change the bits."""
    model, weights = _versions(tiny_qwen3_path)
    reqs, outs = _rollout_with_update(model, weights, update_at=10_000)
    assert all(set(o.versions) == {0} for o in outs)
    load = lambda v: model.load_hf_weights(weights[v], strict=True)  # noqa: E731
    for r, o in zip(reqs, outs):
        tf = model.sequence_logprobs([r.prompt_ids + o.token_ids], [len(r.prompt_ids)], r.temperature)[0]
        again = mixed_version_logprobs(model, r.prompt_ids, o.token_ids, o.versions, r.temperature, load)
        assert torch.equal(bits(again), bits(tf)) and torch.equal(bits(again), bits(o.logprobs))
