"""`weights.transport=nccl` into vLLM engines (rl_kernel.integrations.vllm.nccl), its pure logic on CPU: no
machine here runs NCCL, and nothing here pretends to.

What is real: the `WeightSource` against vLLM's own checks, the payloads parsed by vLLM's own dataclasses,
vime's `VllmRollout.receive_weights` on the engine side, and vLLM's own `NCCLTrainerWeightTransferEngine`
driving the client, with its data plane removed (`NoDataPlane`: no endpoint, nothing broadcast; the source
is still walked through vLLM's checked iteration). The `llm` is a stand-in that records the calls and
parses every payload with vLLM's nccl dataclasses. No tensor reaches it: these tests show the control plane
and the version rule, never that weights arrive."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

from rl_kernel.integrations.vllm.nccl import EngineClient, TensorDictSource, packed_chunks, update_payload

pytestmark = pytest.mark.vllm

HOST = "10.0.0.7"
WEIGHTS = {"b": torch.ones(2, 64, dtype=torch.bfloat16), "a": torch.ones(8, 8), "c": torch.arange(5.0)}


class NoDataPlane(NCCLTrainerWeightTransferEngine):
    """vLLM's trainer engine without its data plane (with `no_endpoint`): everything but the NCCL calls."""

    def _broadcast(self, source, meta):
        for _ in self._checked_iter(source, meta):
            pass


# ---- the source and the payloads --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, "float32"])
def test_source_metadata_and_iteration_agree(dtype):
    source = TensorDictSource(WEIGHTS, dtype)
    meta = source.metadata()
    first = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))  # vLLM's own check of the two
    assert [m.name for m in meta] == [n for n, _ in first] == list(WEIGHTS)  # the dict's order
    assert [(m.dtype, m.shape) for m in meta] == [(t.dtype, tuple(t.shape)) for _, t in first]
    want = [t.dtype for t in WEIGHTS.values()] if dtype is None else [getattr(torch, str(dtype).split(".")[-1])] * 3
    assert [m.dtype for m in meta] == want
    again = list(source)  # re-iterable: the same tensors each pass
    assert all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(first, again))


def test_a_source_whose_iteration_disagrees_is_refused_by_vllm():
    class Uncast(TensorDictSource):  # declares bfloat16, yields the tensors as they are
        def __iter__(self):
            yield from self._items

    with pytest.raises(ValueError, match="disagrees with iteration at index 1: declared 'a' torch.bfloat16"):
        list(NCCLTrainerWeightTransferEngine._checked_iter(Uncast(WEIGHTS, "bfloat16"),
                                                           Uncast(WEIGHTS, "bfloat16").metadata()))


def test_update_payload_is_what_vllm_sends():
    got: list = []

    class Client:  # records what vLLM's trainer engine sends
        init_weight_transfer_engine = start_weight_update = finish_weight_update = lambda self, *a: None

        def update_weights(self, info):
            got.append(info)

    source = TensorDictSource(WEIGHTS, "bfloat16")
    NoDataPlane(client=Client(), source=source).send_weights()
    assert got == [update_payload(source.metadata())]
    info = NCCLWeightTransferUpdateInfo(**got[0])  # as vLLM's worker parses it
    assert (info.names, info.dtype_names, info.shapes) == (["b", "a", "c"], ["bfloat16"] * 3, [[2, 64], [8, 8], [5]])


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@pytest.mark.parametrize("buffer", [1, 200, 256, 300, 700, 1 << 20])
def test_packed_chunks_counts_what_vllms_packer_makes(buffer):
    weights = WEIGHTS | {"d": torch.ones(3, 50), "e": torch.ones(0)}
    source = TensorDictSource(weights)
    it, chunks = iter(source), 0
    while pack_tensors(it, lambda item: item[1], buffer) is not None:
        chunks += 1
    assert packed_chunks(source.metadata(), buffer) == chunks


def test_engines_join_with_offsets_of_their_own():
    sent: list = []
    client = EngineClient(sent.append, [2, 4, 1])
    assert (client.world_size, client.offsets) == (8, [1, 3, 7])
    vllms = NCCLWeightTransferInitInfo(master_address=HOST, master_port=5000, rank_offset=1, world_size=8, packed=True)
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload

    client.init_weight_transfer_engine(worker_init_payload(vllms))
    infos = [NCCLWeightTransferInitInfo(**m["init_info"]) for m in sent[0]]
    # each engine's workers r = 0..tp-1 take rank_offset + r: together exactly 1..world_size-1
    assert sorted(i.rank_offset + r for i, n in zip(infos, [2, 4, 1]) for r in range(n)) == list(range(1, 8))
    assert all((i.master_address, i.master_port, i.world_size, i.packed) == (HOST, 5000, 8, True) for i in infos)
    with pytest.raises(ValueError, match="at least one vLLM worker"):
        EngineClient(sent.append, [2, 0])
