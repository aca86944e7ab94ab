"""Worker-side methods of rl_kernel's engines (strict and native), mixed into vLLM's worker via
`worker_extension_cls` and called by name through `LLM.collective_rpc` (one result per worker, TP rank order)."""

from __future__ import annotations

import rl_kernel as rk


class RLKernelWorkerExtension:
    def rl_kernel_evidence(self) -> list[dict]:
        """`rk.evidence.snapshot()` of this worker: every rl_kernel op that ran since the last reset."""
        return rk.evidence.snapshot()

    def rl_kernel_reset_evidence(self) -> None:
        rk.evidence.reset()

    def rl_kernel_weight_version(self) -> int | None:
        """The weight version this worker's model holds: that of the last finished update session of the
        `rl_kernel_cpu` weight-transfer engine (None before the first, or without that engine)."""
        return getattr(self.weight_transfer_engine, "weight_version", None)

    def rl_kernel_set_modes(self, modes: dict[str, str]) -> dict[str, str]:
        """Set this worker's rl_kernel mode per boundary (later forwards); returns the modes in force."""
        for boundary, m in modes.items():
            rk.set_mode(m, boundary)
        return rk.current_modes()

    def rl_kernel_modes(self) -> dict[str, str]:
        """The rl_kernel mode per boundary in this worker process."""
        return rk.current_modes()

    def rl_kernel_tp_collective(self) -> dict:
        """The strict model's TP collective path in this worker ({"path": "device" | "cpu" | None (TP1 or not the
        strict model), "gathers": eager all-gathers run so far per transport}: rl_kernel.ops.collective)."""
        from rl_kernel.ops.collective import GATHERS_RUN

        model = self.model_runner.get_model()
        return {"path": getattr(model, "tp_collective", None), "gathers": dict(GATHERS_RUN)}

    def rl_kernel_capture_routes(self, top_k: int) -> bool:
        """Record each MoE layer's expert ids of every token this worker's model computes from now on
        (`rl_kernel.integrations.vllm.routes`); False (nothing recorded) for a model without MoE layers."""
        from rl_kernel.integrations.vllm.routes import RouteRecorder

        if getattr(self, "_rl_kernel_routes", None) is None:
            try:
                self._rl_kernel_routes = RouteRecorder(self.model_runner, top_k)
            except ValueError:
                return False
        return True

    def rl_kernel_routes(self) -> dict[str, dict[str, list]]:
        """The routes recorded since the last call, by engine request id (`RouteRecorder.take`); {} when off."""
        recorder = getattr(self, "_rl_kernel_routes", None)
        return recorder.take() if recorder is not None else {}
