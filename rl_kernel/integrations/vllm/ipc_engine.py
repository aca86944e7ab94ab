"""vLLM's `ipc` weight-transfer engine for the strict model (`rl_kernel_ipc`).

vLLM's own engine rebuilds each packed bucket from its CUDA IPC handle on the worker's GPU and hands the tensors
to the model's `load_weights`; around a session it runs vLLM's layerwise reload, which moves every parameter to
the meta device and reloads it through vLLM's weight loaders. The strict model loads in place through its own
layout table (no vLLM weight loaders), so under layerwise reload its loads land on meta tensors and the session
restores the old weights: an engine that acknowledges a version it does not serve. This engine is vLLM's, with
the layerwise session skipped for the strict model (as `rl_kernel_cpu` skips it); other models keep it.
"""

from __future__ import annotations

from rl_kernel.integrations.vllm.model import RLKernelQwen3ForCausalLM
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine


class StrictIPCWeightTransferEngine(IPCWeightTransferEngine):
    def _in_place(self) -> bool:
        return isinstance(self.model, RLKernelQwen3ForCausalLM)

    def start_weight_update(self) -> None:
        if not self._in_place():
            super().start_weight_update()

    def finish_weight_update(self) -> None:
        if not self._in_place():
            super().finish_weight_update()
            return
        importer = getattr(self, "_packed_importer", None)  # vLLM 0.32: release this update's IPC exports
        if importer is not None:
            importer.close()
