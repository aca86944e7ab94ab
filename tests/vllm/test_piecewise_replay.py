"""The strict attention op under vLLM's piecewise CUDA graphs, with graph replay's address rule played on CPU.

A piecewise engine (`compile=True`, FULL_AND_PIECEWISE) cuts the compiled forward at `rl_kernel::vllm_attention`
(vLLM's `split_graph`), captures every other piece as a CUDA graph and runs the op eagerly between them. A captured
graph reads its inputs and writes its outputs at the addresses they had at capture, whatever tensors it is
called with. `StaticReplay` plays that rule on CPU: a piece's first call records its input and output tensors,
every later call reruns it on the recorded inputs and copies the results into the recorded outputs.

Strict: the op fills a buffer that the piece before it allocated, so the piece after it reads that buffer at
its captured address, and a replay with new inputs equals eager's bits. The twin, an op that returns a new
tensor (what `rl_kernel::vllm_attention` did when the H200 found 748 of 1,536 logprobs off): the piece after it
reads the tensor of the capture, and the replay differs from eager.
"""

from __future__ import annotations

import pytest
import torch
from vllm_test_utils import qwen3_layer_config, random_block

import rl_kernel as rk
from rl_kernel.bits import bits
from rl_kernel.integrations.vllm.attention_op import ATTENTION_OP, attend, register_layer
from rl_kernel.models.qwen3 import Qwen3Config

pytestmark = pytest.mark.vllm

TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 40, 128, 4, 2, 32, 256
SCALE = HEAD_DIM**-0.5
LAYER = "model.layers.0.self_attn.attn"
RETURNING_OP = "rl_kernel_test::returning_attention"


class PackedAttention:
    """Stands in for the strict vLLM model behind the op (`register_layer`): causal attention of one packed
    sequence, into `out` where given."""

    def _attention(self, index, q, k, v, out=None):
        result = rk.attention_varlen(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32), SCALE)
        return result if out is None else out.copy_(result)


STAND_IN = PackedAttention()
register_layer(LAYER, STAND_IN, 0)


@torch.library.custom_op(RETURNING_OP, mutates_args=(), schema="(Tensor q, Tensor k, Tensor v) -> Tensor")
def returning_attention(q, k, v):
    return STAND_IN._attention(0, q, k, v).contiguous()


@returning_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class StaticReplay(torch.nn.Module):
    """A captured piece, as CUDA-graph replay runs it: reads the inputs of its first call, writes its outputs."""

    def __init__(self, piece: torch.nn.Module):
        super().__init__()
        self.piece, self.inputs, self.outputs = piece, None, None

    def forward(self, *args):
        if self.inputs is None:
            self.inputs, self.outputs = args, self.piece(*args)
            return self.outputs
        fresh = self.piece(*self.inputs)
        for recorded, new in zip(_tensors(self.outputs), _tensors(fresh)):
            recorded.copy_(new)
        return self.outputs


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _piecewise(splitting_op: str, pieces: list):
    """A torch.compile backend: vLLM's split at `splitting_op`, every other piece replayed as a captured graph."""
    from vllm.compilation.backends import split_graph

    def backend(gm, example_inputs):
        split_gm, items = split_graph(gm, [splitting_op])
        for item in items:
            if not item.is_splitting_graph:
                setattr(split_gm, item.submod_name, StaticReplay(item.graph))
        pieces.append([item.is_splitting_graph for item in items])
        return split_gm

    return backend


@pytest.fixture(scope="module")
def block():
    return random_block(Qwen3Config.from_hf(qwen3_layer_config(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM), "test"), 0.1)


def _step(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16), torch.arange(TOKENS)


def _replayed_and_eager(block, attention, splitting_op: str) -> tuple[list[bool], torch.Tensor, torch.Tensor]:
    """The block compiled, split at the attention op and captured at step 1's inputs, then replayed at step 2's
    (copied into the same input buffers, as vLLM's model runner does); and step 2 run eagerly."""

    def forward(h, positions):
        out, residual = block(h, None, positions, lambda i, q, k, v: attention(q, k, v))
        return torch.cat([out, residual], dim=-1)

    pieces: list = []
    compiled = torch.compile(forward, backend=_piecewise(splitting_op, pieces), fullgraph=True, dynamic=False)
    h, positions = _step(1)
    with rk.mode("strict"), torch.no_grad():
        torch._dynamo.reset()
        compiled(h, positions)  # capture
        h2, positions2 = _step(2)
        h.copy_(h2), positions.copy_(positions2)
        replayed = compiled(h, positions).clone()
        eager = forward(h2, positions2)
    return pieces[0], replayed, eager


def _strict_attention(q, k, v):
    return attend(q, k, v, LAYER)


def test_strict_op_replays_piecewise_with_the_eager_bits(block):
    pieces, replayed, eager = _replayed_and_eager(block, _strict_attention, ATTENTION_OP)
    assert pieces == [False, True, False], pieces  # captured | the op, eager | captured
    assert torch.equal(bits(replayed), bits(eager)), f"{int((bits(replayed) != bits(eager)).sum())} differ"


def test_native_twin_a_returning_op_replays_a_stale_attention(block):
    pieces, replayed, eager = _replayed_and_eager(block, returning_attention, RETURNING_OP)
    assert pieces == [False, True, False], pieces
    differ = int((bits(replayed) != bits(eager)).sum())
    print(f"returning op, replay vs eager: {differ} of {eager.numel()} elements differ")
    assert differ > 0, "the returning op's replay kept eager's bits: the twin shows nothing"
