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
from vllm.distributed.weight_transfer import nccl_engine
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors
from vllm_test_utils import RecordingLLM, cuda_rollout

from rl_kernel.integrations.vllm.nccl import (
    EngineClient,
    TensorDictSource,
    VllmNCCLSender,
    packed_chunks,
    update_payload,
)
from rl_kernel.weights.transfer import WeightVersionError
from vime.errors import WeightSyncError
from vime.weights.sync import VLLM_NCCL, push_transport

pytestmark = pytest.mark.vllm

HOST = "10.0.0.7"
WEIGHTS = {"b": torch.ones(2, 64, dtype=torch.bfloat16), "a": torch.ones(8, 8), "c": torch.arange(5.0)}


def nccl_llm(tp: int = 2, commits: bool = True) -> RecordingLLM:
    """`vllm.LLM` with the `nccl` engine and `tp` workers, recorded; payloads parsed by vLLM's nccl dataclasses."""
    return RecordingLLM(NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo, tp, commits)


class NoDataPlane(NCCLTrainerWeightTransferEngine):
    """vLLM's trainer engine without its data plane (with `no_endpoint`): everything but the NCCL calls."""

    def _broadcast(self, source, meta):
        for _ in self._checked_iter(source, meta):
            pass


@pytest.fixture
def no_endpoint(monkeypatch):
    """vLLM's `trainer_init` opens no NCCL endpoint; records each init info it is given."""
    opened: list = []
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", opened.append)
    return opened


def _engines(model_path, n: int = 2, tp: int = 2, version: int = 0, commits: bool = True):
    """`n` vime VllmRollout engines on CUDA with `transport="nccl"` over stand-in `llm`s (no engine is built)."""
    engines = [cuda_rollout(model_path, nccl_llm(tp, commits), transport="nccl") for _ in range(n)]
    for e in engines:
        e.version = version
    return engines


def _sender(engines, sent: list | None = None, **kw) -> VllmNCCLSender:
    def send(msgs):
        if sent is not None:
            sent.append([m["op"] for m in msgs])
        return [e.receive_weights(m) for e, m in zip(engines, msgs)]

    return VllmNCCLSender(
        send, len(engines), HOST, dtype="bfloat16", buffer_bytes=4096, trainer_init=NoDataPlane.trainer_init, **kw
    )


@pytest.fixture(scope="module")
def state(tiny_qwen3_path):
    from rl_kernel.models.qwen3 import load_hf_state_dict

    return load_hf_state_dict(tiny_qwen3_path)


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
        list(
            NCCLTrainerWeightTransferEngine._checked_iter(
                Uncast(WEIGHTS, "bfloat16"), Uncast(WEIGHTS, "bfloat16").metadata()
            )
        )


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


# ---- a push through vime's engines ------------------------------------------------------------------------


def test_a_push_forms_the_group_once_and_every_engine_serves_its_version(tiny_qwen3_path, state, no_endpoint):
    engines = _engines(tiny_qwen3_path, n=2, tp=2)
    sent: list = []
    sender = _sender(engines, sent)
    ack = sender.push(state, 1)
    nbytes = sum(t.numel() * 2 for t in state.values())  # bfloat16 on the wire
    assert ack == {
        "version": 1,
        "tensors": len(state),
        "bytes": nbytes,
        "buckets": packed_chunks(TensorDictSource(state, "bfloat16").metadata(), 4096),
    }
    assert ack["buckets"] > 1
    assert [i.world_size for i in no_endpoint] == [5] and no_endpoint[0].master_address == HOST
    assert sent[:3] == [["start"] * 2, ["ranks"] * 2, ["init_weight_transfer_engine"] * 2]  # checked, then NCCL
    for i, engine in enumerate(engines):
        init, start, update, finish = engine.llm.calls
        assert init[1].rank_offset == 1 + 2 * i and init[1].world_size == 5 and start == ("start",)
        assert update[1].names == list(state) and finish == ("finish", "1")
        assert engine.set_version(1) == 1
    sender.push(state, 2)  # the group stays: no second rendezvous
    assert len(no_endpoint) == 1
    assert [c[0] for c in engines[0].llm.calls] == ["init"] + ["start", "update", "finish"] * 2
    assert all(e.set_version(2) == 2 for e in engines)


def test_a_stale_version_is_refused_before_any_nccl_call(tiny_qwen3_path, state, no_endpoint):
    engines = _engines(tiny_qwen3_path, version=3)
    sent: list = []
    sender = _sender(engines, sent)
    with pytest.raises(
        WeightSyncError, match="rollout engine 0: weight push refused: weight version 2 offered to an engine serving 3"
    ):
        sender.push(state, 2)
    assert sent == [["start", "start"]] and no_endpoint == [] and sender.engine is None
    assert all(e.llm.calls == [] for e in engines)


def test_a_version_that_does_not_grow_is_refused_by_the_sender(tiny_qwen3_path, state, no_endpoint):
    engines = _engines(tiny_qwen3_path)
    sent: list = []
    sender = _sender(engines, sent)
    sender.push(state, 1)
    before = len(sent)
    for version in (1, 0, True):
        with pytest.raises(WeightVersionError, match="versions must grow|must be an int"):
            sender.push(state, version)
    assert len(sent) == before


def test_a_push_of_other_weights_is_refused_before_any_nccl_call(tiny_qwen3_path, state, no_endpoint):
    engines = _engines(tiny_qwen3_path)
    first = next(iter(state))
    with pytest.raises(WeightSyncError, match="weight push refused: version 1 lacks 1 weights"):
        _sender(engines).push({k: v for k, v in state.items() if k != first}, 1)
    engines = _engines(tiny_qwen3_path)
    with pytest.raises(WeightSyncError, match=f"{first}: pushed float32.*engine holds bfloat16"):
        VllmNCCLSender(
            lambda msgs: [e.receive_weights(m) for e, m in zip(engines, msgs)],
            2,
            HOST,
            dtype="float32",
            trainer_init=NoDataPlane.trainer_init,
        ).push(state, 1)
    assert no_endpoint == []


def test_a_vllm_that_does_not_serve_the_pushed_version_fails_the_push(tiny_qwen3_path, state, no_endpoint):
    engines = _engines(tiny_qwen3_path, commits=False)
    with pytest.raises(WeightSyncError, match="vLLM serves weight version '0' after the push of version 1"):
        _sender(engines).push(state, 1)
    with pytest.raises(WeightSyncError, match="the last nccl push was version 0 and vLLM serves 0"):
        engines[0].set_version(1)


def test_an_acknowledgement_that_does_not_match_fails_the_push(tiny_qwen3_path, state, no_endpoint):
    engines = _engines(tiny_qwen3_path)

    def send(msgs):  # engine 1's acknowledgement claims a tensor less
        out = [e.receive_weights(m) for e, m in zip(engines, msgs)]
        return [out[0], {**out[1], "tensors": out[1]["tensors"] - 1}] if msgs[0]["op"] == "finish" else out

    sender = VllmNCCLSender(send, 2, HOST, dtype="bfloat16", trainer_init=NoDataPlane.trainer_init)
    with pytest.raises(WeightVersionError, match=f"engine acknowledged {len(state) - 1} tensors"):
        sender.push(state, 1)


def test_messages_out_of_order_are_refused(tiny_qwen3_path, state):
    (engine,) = _engines(tiny_qwen3_path, n=1)
    payload = update_payload(TensorDictSource(state, "bfloat16").metadata())
    with pytest.raises(WeightSyncError, match="'start_weight_update' of weight version 1 during the push of None"):
        engine.receive_weights({"op": "start_weight_update", "version": 1})
    engine.receive_weights({"op": "start", "version": 1, **payload})
    with pytest.raises(WeightSyncError, match="'update_weights' of weight version 2 during the push of 1"):
        engine.receive_weights({"op": "update_weights", "version": 2, "update_info": payload})
    short = {k: v[1:] for k, v in payload.items()}
    engine.receive_weights({"op": "update_weights", "version": 1, "update_info": short})
    with pytest.raises(
        WeightSyncError, match=f"vLLM was sent {len(state) - 1} tensors, not the {len(state)} tensors checked at start"
    ):
        engine.receive_weights({"op": "finish", "version": 1})
    with pytest.raises(WeightVersionError, match="finish of weight version '3' during the push of 1"):
        client = EngineClient(lambda msgs: msgs, [1])
        client.version = 1
        client.finish_weight_update("3")


def test_vllm_engines_on_nccl_get_vllms_push():
    assert push_transport("nccl", "vllm") == VLLM_NCCL
    assert [push_transport(t, e) for t, e in [("ipc", "vllm"), ("nccl", "reference"), ("object_store", "vllm")]] == [
        "ipc",
        "nccl",
        "object_store",
    ]
