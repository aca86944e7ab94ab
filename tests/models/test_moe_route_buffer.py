"""The MoE blocks' device route buffers (`SparseMoeBlock.route_buffer`) and `RouteRecorder`'s reading of them.

Every forward copies its expert ids into rows [0, T) of a fixed-address buffer, so the routes of a forward replayed
from a CUDA graph (no Python hook runs) land there too; the recorder reads the buffers after each runner forward.
CPU: the buffer equals the ids the block returns (the routes list) and leaves the output bits alone; a too small
buffer fails in one line; the recorder records from the buffers alone (a "replayed" forward that runs no module).
CUDA (skipped without): the block captured in a torch.cuda.CUDAGraph writes each replay's routes into the buffer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rl_kernel.bits import same_bits
from rl_kernel.integrations.vllm import routes as routes_mod
from rl_kernel.integrations.vllm.routes import RouteRecorder, allocate_route_buffers, route_buffer_rows
from rl_kernel.models.layers import SparseMoeBlock

EXPERTS, TOP_K, DIM, FFN = 8, 2, 64, 32


def _block(device: str = "cpu", seed: int = 0) -> SparseMoeBlock:
    config = SimpleNamespace(
        hidden_size=DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, moe_intermediate_size=FFN
    )
    block = SparseMoeBlock(config, torch.bfloat16, device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.05)
    return block


def _x(tokens: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tokens, DIM, generator=g, device=device).to(torch.bfloat16)


def test_route_buffer_holds_the_forwards_ids_and_leaves_its_bits():
    block, x = _block(), _x(13)
    plain = block(x)
    allocate_route_buffers(block, 32)
    block.routes = []
    out = block(x)
    assert same_bits(out, plain), "writing the route buffer changed the block's output"
    (ids,) = block.routes
    assert block.route_buffer.dtype == torch.int16 and block.route_buffer.shape == (32, TOP_K)
    assert torch.equal(block.route_buffer[:13], ids.to(torch.int16))
    assert bool((block.route_buffer[13:] == -1).all()), "rows past the forward's tokens were written"
    block(_x(5, seed=2))
    assert torch.equal(block.route_buffer[5:13], ids[5:].to(torch.int16)), "a shorter forward wrote past its rows"


def test_too_small_route_buffer_fails_in_one_line():
    block = _block()
    allocate_route_buffers(block, 4)
    with pytest.raises(ValueError, match=r"route_buffer holds 4 rows, the forward has 5 tokens"):
        block(_x(5))


def test_route_buffer_rows_covers_batched_tokens_and_graph_sizes():
    def config(tokens, sizes):
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=tokens),
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=sizes),
        )

    assert route_buffer_rows(config(256, [1, 2, 4, 512])) == 512
    assert route_buffer_rows(config(2048, [1, 8, 64])) == 2048
    assert route_buffer_rows(config(128, [])) == 128


class _Model(nn.Module):
    def __init__(self, blocks: list[SparseMoeBlock]):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(blocks)


class _Runner:
    """A model runner whose `_model_forward` only writes the route buffers, as a replayed CUDA graph does: no
    module's forward (no hook) runs."""

    def __init__(self, model: _Model):
        self.model, self.input_batch = model, SimpleNamespace(req_ids=["a", "b"])

    def get_model(self) -> _Model:
        return self.model

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
        for i, block in enumerate(self.model.model.layers):
            block.route_buffer[: positions.numel()] = torch.arange(positions.numel() * TOP_K).view(-1, TOP_K) + i
        return positions


def test_recorder_reads_the_buffers_of_a_forward_that_ran_no_module(monkeypatch):
    model = _Model([_block(seed=0), _block(seed=1)])
    allocate_route_buffers(model, 8)
    runner = _Runner(model)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 2, 3]))
    monkeypatch.setattr(routes_mod, "_attention_metadata", lambda: meta)
    recorder = RouteRecorder(runner, TOP_K)
    assert recorder.strict
    runner._model_forward(input_ids=None, positions=torch.tensor([7, 8, 4, 0]))  # 3 rows fed, 1 padding row
    got = recorder.take()
    assert got["a"]["positions"] == [7, 8] and got["b"]["positions"] == [4]
    assert got["a"]["experts"][1] == [[2, 3], [3, 4]] and got["b"]["experts"][0] == [[4, 5], [5, 6]]
    recorder.close()
    assert "_model_forward" not in runner.__dict__, "close left the runner's forward wrapped"


def test_recorder_needs_the_buffers():
    model = _Model([_block()])
    with pytest.raises(RuntimeError, match="no route_buffer"):
        RouteRecorder(_Runner(model), TOP_K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_writes_the_routes_into_the_buffer():
    """The block captured in a CUDA graph (capture raises on a host sync): each replay on new tokens leaves the
    eager forward's expert ids in the buffer's rows and the eager output bits in the graph's output. The twin: the
    Python routes list, today's hook path, gets nothing from a replay."""
    pytest.importorskip("triton")
    block, static_x = _block("cuda"), _x(16, "cuda")
    allocate_route_buffers(block, 16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        block(static_x)  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    for seed in range(2, 5):
        new = _x(16, "cuda", seed=seed)
        static_x.copy_(new)
        block.route_buffer.fill_(-1)
        block.routes = []
        graph.replay()
        assert block.routes == [], "a replay ran the block's Python forward"
        replayed = block.route_buffer.clone()
        block.routes = []
        out = block(new)
        (ids,) = block.routes
        block.routes = None
        assert torch.equal(replayed, ids.to(torch.int16)), "the replay's routes did not land in the buffer"
        assert same_bits(static_out, out), "CUDA-graph replay differs from eager"
