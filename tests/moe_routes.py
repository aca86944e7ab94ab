"""What the MoE engine tests (CPU and GPU) share: an engine's recorded routes per request, the reference's
teacher forcing with its routes, and vime's routing agreement of the two."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def engine_routes(llm, outputs, prompts: list[list[int]]) -> list:
    """Each request's recorded expert ids of the positions it fed (vime's `VllmEngine._routes`); the engine had
    `llm.collective_rpc("rl_kernel_capture_routes", args=(top_k,))` before its `generate`."""
    from rl_kernel.integrations.vllm.routes import routes_of

    records = llm.collective_rpc("rl_kernel_routes")[0]
    return [
        routes_of(records, o.request_id, len(p) + len(o.outputs[0].token_ids) - 1) for o, p in zip(outputs, prompts)
    ]


def teacher_forcing(reference, prompts, tokens, temperature: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The reference's fp32 logprobs of the same tokens (all sequences in one varlen pack, reverse order) and its
    routes per sequence (int16 [len, MoE layers, k]) from the same forward."""
    from rl_kernel.models.qwen3_moe import capture_routes

    seqs = [p + t for p, t in zip(prompts, tokens)][::-1]
    lens = [len(p) for p in prompts][::-1]
    with capture_routes(reference.model) as captured:
        want = reference.sequence_logprobs(seqs, lens, temperature)[::-1]
    assert captured and all(len(layer) == 1 for layer in captured), "teacher forcing ran more than one forward"
    rows = torch.stack([layer[0] for layer in captured], dim=1).to("cpu", torch.int16)
    assert rows.shape[0] == sum(len(s) for s in seqs), (rows.shape, sum(len(s) for s in seqs))
    routes = list(rows.split([len(s) for s in seqs]))[::-1]
    return torch.cat(want).float().cpu(), routes


def routing(engine: list, reference: list[torch.Tensor]) -> dict:
    """vime's routing agreement (`consistency/routing_mismatch`) of the engine's routes vs the reference's."""
    from vime.loop.consistency import routing_agreement

    got = routing_agreement([SimpleNamespace(routes=r) for r in engine], [SimpleNamespace(routes=r) for r in reference])
    assert got is not None and got["routes_compared"] > 0, "no route was recorded on both sides"
    return got
