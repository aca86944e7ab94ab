"""rl_kernel's `ipc` weight push (`rl_kernel.weights.transfer`) into a vLLM engine on CUDA, through
vLLM's own `ipc` weight-transfer engine (packed mode) and its weight-update API.

Written against vllm 0.32 and 0.26 (`vllm/distributed/weight_transfer/ipc_engine.py`; their differences: compat)
and tested only with a stand-in `llm` object: no machine here runs vLLM on a GPU (docs/vllm.md, "CUDA path:
written, not run").
"""

from __future__ import annotations

from rl_kernel.integrations.vllm import finish_weight_update
from rl_kernel.integrations.vllm.compat import ipc_init_info, ipc_update_info
from rl_kernel.weights.transfer import ALIGN, TensorMeta, WeightReceiver


class VllmIPCReceiver(WeightReceiver):
    """Engine side of a push into `llm` (an engine built with `transport="ipc"`).

    `WeightReceiver`'s checks come first (versions grow, the push names exactly `expected` with its shapes
    and dtypes, bucket count), then each message becomes a call of vLLM's weight-update API: `start` ->
    `llm.start_weight_update()`; `bucket` -> `llm.update_weights` with the fields of vLLM's
    `IPCWeightTransferUpdateInfo` (packed: the bucket buffer's handle per GPU uuid, `tensor_sizes`); `finish`
    -> `finish_weight_update(llm, version)` (vLLM's engine weight version, prefix cache reset) and the
    acknowledgement {version, tensors, bytes}. The tensors never pass through this process: vLLM's workers
    rebuild the buffer from the handle on their own GPU."""

    def __init__(self, llm, expected: dict[str, TensorMeta], *, version: int = 0):
        super().__init__(load=None, device="cpu", expected=expected, version=version)  # type: ignore[arg-type]
        self.llm = llm
        # rl_kernel pushes packed buckets: vLLM's ipc engine reads `packed` from its init info (0.32) or from
        # each update (0.26), default False (compat)
        llm.init_weight_transfer_engine({"init_info": ipc_init_info(packed=True)})

    def handle(self, msg: dict) -> dict | None:
        ack = super().handle(msg)
        if msg.get("op") == "start":
            self.llm.start_weight_update()
        elif ack is not None:
            finish_weight_update(self.llm, ack["version"])
        return ack

    def _load_bucket(self, msg: dict, metas: list[TensorMeta], sizes: list[int]) -> None:
        if "ipc_handle" not in msg:
            raise ValueError(
                f"bucket {msg.get('bucket')} has no ipc_handle: vLLM engines take the ipc transport "
                "only (vLLM's nccl engine has a rendezvous and wire of its own)"
            )
        padded = [m.name for m, n in zip(metas, sizes) if n != m.nbytes]
        if padded:
            raise ValueError(
                f"vLLM's packed IPC reader takes tensors back to back, but {len(padded)} tensor(s) of "
                f"bucket {msg.get('bucket')} are padded to {ALIGN} bytes, e.g. {padded[:3]}"
            )
        self.llm.update_weights(
            {
                "update_info": ipc_update_info(
                    [m.name for m in metas],
                    [m.dtype_name for m in metas],
                    [list(m.shape) for m in metas],
                    msg["ipc_handle"],
                    sizes,
                )
            }
        )
