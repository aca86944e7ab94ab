"""The vLLM CUDA path's pure logic, on CPU (no machine here runs vLLM on a GPU): engine arguments per
device and transport, and the translation of rl_kernel's `ipc` push into vLLM's weight-update API. The
`llm` here is a stand-in that records the calls and parses every payload with vLLM's own ipc dataclasses."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CompilationConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo

from rl_kernel.integrations.vllm import (
    LOGITS_PROCESSOR,
    WEIGHT_TRANSFER_BACKEND,
    WORKER_EXTENSION,
    native_llm_kwargs,
    strict_llm_kwargs,
)
from rl_kernel.integrations.vllm.ipc import VllmIPCReceiver
from rl_kernel.models.weight_transfer import TensorMeta, WeightSender, WeightVersionError
from vime.errors import WeightSyncError

pytestmark = pytest.mark.vllm

HANDLE = {"GPU-0000": ("rebuild_cuda_tensor args",)}


def test_cpu_kwargs_are_unchanged(tiny_qwen3_path):
    strict = strict_llm_kwargs(tiny_qwen3_path)
    assert strict["enforce_eager"] is True and "compilation_config" not in strict
    assert strict["weight_transfer_config"] == {"backend": WEIGHT_TRANSFER_BACKEND}
    assert strict["logits_processors"] == [LOGITS_PROCESSOR] and strict["worker_extension_cls"] == WORKER_EXTENSION
    assert native_llm_kwargs(tiny_qwen3_path, seed=3) == {
        "model": str(tiny_qwen3_path), "logprobs_mode": "processed_logprobs", "enforce_eager": True,
        "weight_transfer_config": {"backend": WEIGHT_TRANSFER_BACKEND}, "worker_extension_cls": WORKER_EXTENSION,
        "seed": 3}
    with pytest.raises(ValueError, match="enforce_eager=True"):
        strict_llm_kwargs(tiny_qwen3_path, enforce_eager=False)
    with pytest.raises(ValueError, match="on CPU weights go through 'rl_kernel_cpu'"):
        strict_llm_kwargs(tiny_qwen3_path, transport="ipc")


@pytest.mark.parametrize("transport, backend", [(None, "ipc"), ("ipc", "ipc"), ("nccl", "nccl")])
def test_cuda_kwargs(tiny_qwen3_path, transport, backend):
    strict = strict_llm_kwargs(tiny_qwen3_path, device="cuda", transport=transport)
    assert "enforce_eager" not in strict and strict["logprobs_mode"] == "processed_logits"
    assert strict["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert strict["weight_transfer_config"] == {"backend": backend}
    native = native_llm_kwargs(tiny_qwen3_path, device="cuda:0", transport=transport)
    assert "enforce_eager" not in native and "compilation_config" not in native
    assert native["weight_transfer_config"] == {"backend": backend}
    # vLLM's own config classes take these spellings
    assert CompilationConfig(**strict["compilation_config"]).cudagraph_mode.name == "FULL_DECODE_ONLY"
    assert WeightTransferConfig(**strict["weight_transfer_config"]).backend == backend


def test_cuda_kwargs_refuse_what_strict_mode_cannot_run(tiny_qwen3_path):
    assert strict_llm_kwargs(tiny_qwen3_path, device="cuda", enforce_eager=True)["enforce_eager"] is True
    assert strict_llm_kwargs(tiny_qwen3_path, device="cuda", compilation_config={"cudagraph_mode": "NONE"}
                             )["compilation_config"] == {"cudagraph_mode": "NONE"}
    with pytest.raises(ValueError, match="pure-decode batches only.*'PIECEWISE'"):
        strict_llm_kwargs(tiny_qwen3_path, device="cuda", compilation_config={"cudagraph_mode": "PIECEWISE"})
    with pytest.raises(ValueError, match="one of \\('ipc', 'nccl'\\), got 'object_store'"):
        native_llm_kwargs(tiny_qwen3_path, device="cuda", transport="object_store")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        native_llm_kwargs(tiny_qwen3_path, device="tpu")


class FakeLLM:
    """`vllm.LLM`'s weight-update API (vllm/entrypoints/rl/offline.py), recorded; payloads parsed by vLLM."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.weight_version = "0"

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init", IPCWeightTransferInitInfo(**request["init_info"])))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, request):
        self.calls.append(("update", IPCWeightTransferUpdateInfo(**request["update_info"])))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))
        self.weight_version = weight_version

    def reset_prefix_cache(self):
        return True

    def get_weight_version(self):
        return self.weight_version


class HandleSender(WeightSender):
    """rl_kernel's sender with a stand-in IPC handle (the buffer stays here: nothing reads it)."""

    def _ship(self, msg, buf):
        self._send({**msg, "ipc_handle": HANDLE})
        return buf


def _wire(handle) -> HandleSender:
    """A sender whose messages go to `handle` (a receiver's `handle`, an engine's `receive_weights`)."""
    replies: list[dict] = []

    def send(msg):
        ack = handle(msg)
        if ack is not None:
            replies.append(ack)

    return HandleSender("ipc", send, replies.pop, bucket_bytes=512)


WEIGHTS = {"a": torch.ones(8, 8), "b": torch.ones(2, 64, dtype=torch.bfloat16), "c": torch.ones(64)}  # 256 B each
EXPECTED = {n: TensorMeta.of(n, t) for n, t in WEIGHTS.items()}


def test_ipc_push_becomes_vllm_weight_update_calls():
    llm = FakeLLM()
    receiver = VllmIPCReceiver(llm, EXPECTED)
    ack = _wire(receiver.handle).push(WEIGHTS.items(), version=1)
    assert ack == {"version": 1, "tensors": 3, "bytes": 768, "buckets": 2}
    init, start, up0, up1, finish = llm.calls
    assert init == ("init", IPCWeightTransferInitInfo(packed=True)) and start == ("start",)
    assert finish == ("finish", "1") and receiver.version == 1
    assert (up0[1].names, up0[1].dtype_names, up0[1].shapes) == (["a", "b"], ["float32", "bfloat16"], [[8, 8], [2, 64]])
    assert (up0[1].ipc_handles, up0[1].tensor_sizes) == (HANDLE, [256, 256])
    assert (up1[1].names, up1[1].tensor_sizes) == (["c"], [256])


@pytest.mark.parametrize("weights, version, error", [
    (WEIGHTS, 0, "version 0 offered to an engine serving 0"),
    ({"a": WEIGHTS["a"], "b": WEIGHTS["b"]}, 1, "lacks 1 weights, e.g. \\['c'\\]"),
    (WEIGHTS | {"d": torch.ones(64)}, 1, "no weight 'd'"),
    (WEIGHTS | {"c": torch.ones(64, dtype=torch.float16)}, 1, "c: pushed float16\\[64\\], engine holds float32"),
])
def test_ipc_push_that_does_not_fit_fails_before_vllm_sees_it(weights, version, error):
    llm = FakeLLM()
    with pytest.raises((WeightVersionError, KeyError, ValueError), match=error):
        _wire(VllmIPCReceiver(llm, EXPECTED).handle).push(weights.items(), version=version)
    assert [c[0] for c in llm.calls] == ["init"]


def test_padded_or_handleless_buckets_are_refused():
    odd = {"n": torch.ones(3)}  # 12 bytes in a 256-byte slot: vLLM's reader would misplace what follows
    llm = FakeLLM()
    with pytest.raises(ValueError, match="1 tensor\\(s\\) of bucket 0 are padded to 256 bytes, e.g. \\['n'\\]"):
        _wire(VllmIPCReceiver(llm, {"n": TensorMeta.of("n", odd["n"])}).handle).push(odd.items(), version=1)
    receiver = VllmIPCReceiver(FakeLLM(), EXPECTED)
    meta = EXPECTED["a"]
    start = {"op": "start", "version": 1, "names": list(EXPECTED), "dtype_names": [m.dtype_name for m in
             EXPECTED.values()], "shapes": [list(m.shape) for m in EXPECTED.values()]}
    receiver.handle(start)
    with pytest.raises(ValueError, match="bucket 0 has no ipc_handle: vLLM engines take the ipc transport only"):
        receiver.handle({"op": "bucket", "version": 1, "bucket": 0, "names": ["a"], "dtype_names": ["float32"],
                         "shapes": [[8, 8]], "tensor_sizes": [meta.nbytes]})


def _cuda_rollout(model_path):
    """A VllmRollout on CUDA as its __init__ leaves it, over the stand-in `llm` (no engine is built)."""
    from vime.rollout.vllm_engine import VllmRollout

    rollout = VllmRollout.__new__(VllmRollout)
    rollout.llm, rollout.cuda, rollout.model_path, rollout.dtype = FakeLLM(), True, str(model_path), "bfloat16"
    rollout.engine_id, rollout.version, rollout._receiver = 0, 0, None
    return rollout


def test_vllm_rollout_on_cuda_fails_closed_with_weight_sync_errors(tiny_qwen3_path):
    from rl_kernel.models.qwen3 import load_hf_state_dict

    rollout = _cuda_rollout(tiny_qwen3_path)
    state = load_hf_state_dict(tiny_qwen3_path)
    start = {"op": "start", "version": 1, "names": list(state), "dtype_names": ["bfloat16"] * len(state),
             "shapes": [list(t.shape) for t in state.values()]}
    with pytest.raises(WeightSyncError, match="rollout engine 0: weight push refused: version 1 lacks 1 weights"):
        rollout.receive_weights({**start, "names": start["names"][1:], "dtype_names": start["dtype_names"][1:],
                                 "shapes": start["shapes"][1:]})
    assert rollout.receive_weights(start) is None and rollout.llm.calls[-1] == ("start",)
    with pytest.raises(WeightSyncError, match="push of version 2 started while version 1"):
        rollout.receive_weights({**start, "version": 2})
    with pytest.raises(WeightSyncError, match="asked to serve weight version 1; the last ipc push was version 0 "
                                              "and vLLM serves 0"):
        rollout.set_version(1)
    with pytest.raises(WeightSyncError, match="ipc push \\(receive_weights\\)"):
        rollout.update_weights({}, 1)
    with pytest.raises(WeightSyncError, match="ipc weight transport only"):
        rollout.join_weight_group("127.0.0.1", 1, 1, 2)


def test_vllm_rollout_on_cuda_serves_the_version_its_push_finished(tiny_qwen3_path):
    rollout = _cuda_rollout(tiny_qwen3_path)
    rollout._receiver = VllmIPCReceiver(rollout.llm, EXPECTED)
    _wire(rollout.receive_weights).push(WEIGHTS.items(), version=3)
    assert rollout.set_version(3) == 3 == rollout.version
    with pytest.raises(WeightSyncError, match="asked to serve weight version 4; the last ipc push was version 3"):
        rollout.set_version(4)
