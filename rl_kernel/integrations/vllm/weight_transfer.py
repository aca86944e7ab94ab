"""A CPU weight-transfer engine for vLLM's RL weight-update API (`LLM.start_weight_update`,
`update_weights`, `finish_weight_update`), registered as `rl_kernel_cpu`.

vLLM's own engines move CUDA memory (IPC handles, NCCL); on CPU the trainer writes HF-named full
tensors into a safetensors file on shared memory (`/dev/shm` where it exists) and every worker maps
it and loads the tensors through the model's `load_weights`, which shards them for its TP rank.
Each update carries an integer weight version; the model keeps it (reported by
`rl_kernel.integrations.vllm.worker_weight_versions`) and `finish_weight_update(weight_version=...)`
sets vLLM's own engine weight version, which every output then carries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from safetensors.torch import safe_open

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "rl_kernel_cpu"


@dataclasses.dataclass
class CPUInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the transport is a file the trainer names in each update."""


@dataclasses.dataclass
class CPUUpdateInfo(WeightTransferUpdateInfo):
    path: str  # safetensors file of HF-named tensors (full, unsharded; any subset of the model's)
    version: int  # the weight version these tensors are

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool):
            raise ValueError(f"weight version must be an int, got {self.version!r}")


class CPUWeightTransferEngine(WeightTransferEngine[CPUInitInfo, CPUUpdateInfo]):
    init_info_cls = CPUInitInfo
    update_info_cls = CPUUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: CPUInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronise

    def receive_weights(self, update_info: CPUUpdateInfo) -> None:
        if not hasattr(self.model, "weight_version"):
            raise TypeError(f"the {BACKEND} weight-transfer engine serves rl_kernel's strict model, not "
                            f"{type(self.model).__name__}")
        with safe_open(update_info.path, framework="pt") as f:
            self.model.load_weights((name, f.get_tensor(name)) for name in f.keys())
        self.model.weight_version = update_info.version

    def shutdown(self) -> None:
        pass
